"""Threat model, item 6: a chat template from a received model folder renders in jinja2's sandbox within a time
and a size limit. Nested `range(100000)` loops (hours of work) and `'x' * 6000000000` (6 GB in one step) are each
one TemplateLimitError naming the file, within seconds and without the allocation; through `mindvl chat` the same
folder is one line, exit 2 (tests/bad_inputs.py, chat-template-bomb)."""

from __future__ import annotations

import time

import pytest

from mindvl.infer.chat import template_default_system, training_system
from mindvl.infer.jinja_sandbox import TemplateLimitError, render_template

SLOW = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HUGE = "{{ 'x' * 6000000000 }}"
WIDE = "{% for i in range(100000) %}{{ 'yyyyyyyyyyyyyyyyyyyy' }}{% endfor %}"  # 2 MB of output, in small chunks
QWEN = ("{% for m in messages %}{% if loop.first and m.role != 'system' %}<|im_start|>system\nBe brief.<|im_end|>\n"
        "{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")


def test_a_slow_template_stops_at_the_time_limit():
    t0 = time.monotonic()
    with pytest.raises(TemplateLimitError, match=r"t\.jinja: the chat template ran for more than 0\.5 s"):
        render_template(SLOW, "t.jinja", max_seconds=0.5, messages=[])
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("template,message", [(HUGE, "builds a value of 6000000000 items"),
                                              ("{{ [1] * 10**9 }}", "builds a value of 1000000000 items"),
                                              ("{{ 9 ** 99999999 }}", "raises to the power 99999999"),
                                              (WIDE, "renders more than 1048576 characters")])
def test_a_template_building_too_much_is_refused_before_it_allocates(template, message):
    with pytest.raises(TemplateLimitError, match=message):
        render_template(template, "t.jinja", messages=[])


def test_a_normal_template_renders_as_before():
    assert template_default_system(QWEN) == "Be brief."
    assert render_template("{{ 'ab' * 3 }}{{ '%s-%d' % ('x', 2) }}", "t") == "ababab" + "x-2"


def test_training_system_names_the_folder_file(tmp_path):
    (tmp_path / "chat_template.jinja").write_text(HUGE)
    with pytest.raises(TemplateLimitError, match=f"{tmp_path / 'chat_template.jinja'}: the chat template builds"):
        training_system(tmp_path)
