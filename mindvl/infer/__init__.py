"""mindvl.infer: KV-cache generation and chat (ARCHITECTURE.md §2).

    generate(model, [Prompt(ids, pixel_values, grid_thw), ...], max_new_tokens, temperature, top_p, top_k, seed,
             stop_token_ids, sync_every, graphs) -> generated ids per prompt (static KV cache)
    generate_sorted(model, prompts, max_new_tokens, token_budget, max_batch, ...) -> the same, in length-sorted
             batches (evaluation sets), answers in the prompts' order
    chat(model, tokenizer, text, images, ...) -> answer;  ChatSession for several turns
    load_for_chat(model_dir, tokenizer=None) -> (model, tokenizer)
"""

from .batching import generate_sorted
from .chat import ChatSession, chat, conversation_prompt, load_for_chat, process_images, resolve_tokenizer
from .generate import Prompt, generate, next_tokens

__all__ = [
    "ChatSession",
    "Prompt",
    "chat",
    "conversation_prompt",
    "generate",
    "generate_sorted",
    "load_for_chat",
    "next_tokens",
    "process_images",
    "resolve_tokenizer",
]
