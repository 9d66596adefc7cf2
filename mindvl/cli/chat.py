"""`mindvl chat MODEL --image FILE --video FILE --prompt TEXT`: ask a model folder about images and videos and print
the answer.

Without --prompt: an interactive conversation when stdin is a terminal (an empty line or EOF ends it), otherwise
the whole of stdin is the prompt.
"""

from __future__ import annotations

import os
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser("chat", help="ask a model folder about images (KV-cache generation)")
    p.add_argument("model", help="a mindvl model folder (mindvl export / convert / a run's final/)")
    p.add_argument("--image", action="append", default=[], metavar="FILE", help="an image; repeat for several")
    p.add_argument("--video", action="append", default=[], metavar="FILE",
                   help="a video (needs the video extra: pip install 'mindvl[video]'); repeat for several")
    p.add_argument("--video-fps", type=float, help="frames sampled per second of video (default: the folder's "
                   "video_preprocessor_config.json, else 2)")
    p.add_argument("--prompt", help="the question; omit it for an interactive chat (or to read stdin)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="stop after this many new tokens (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass; 1 = off (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, help="seed for sampling (reproducible answers)")
    p.add_argument("--min-pixels", type=int, help="smallest resized image area (default: the folder's "
                   "preprocessor_config.json, else 3136)")
    p.add_argument("--max-pixels", type=int, help="largest resized image area (default: the folder's "
                   "preprocessor_config.json, else 1003520)")
    p.add_argument("--tokenizer", metavar="DIR", help="tokenizer folder or tokenizer.json (default: the model's)")
    p.add_argument("--system", help="system prompt (default: the one the model was trained with: its run's "
                   "data.default_system, else its chat template's; printed on stderr)")
    p.add_argument("--no-system", action="store_true", help="no system turn (as recipes with default_system: null)")
    p.add_argument("--device", help="cuda, cpu, ... (default: cuda when available)")
    p.set_defaults(func=run)


def run(args) -> int:
    from mindvl.data.video import require_decoder
    from mindvl.infer.chat import (
        ChatSession,
        describe_system,
        folder_processing,
        load_for_chat,
        pixel_limits,
        training_system,
        video_settings,
    )
    from mindvl.infer.generate import check_sampling

    # Everything the arguments alone can tell is checked before the model loads (minutes for a large one).
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    check_sampling(args.temperature, args.top_p, args.top_k)
    for kind, files in (("image", args.image), ("video", args.video)):
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:  # before "install PyAV": a wrong path is the first thing to fix
            raise FileNotFoundError(f"{kind} file not found: {missing[0]}")
    if args.video:
        try:
            require_decoder()  # before loading the model: name the missing extra at once
        except ImportError as exc:
            raise ValueError(str(exc)) from exc  # the CLI prints it as one line
        if args.video_fps is not None and args.video_fps <= 0:
            raise ValueError(f"--video-fps must be > 0, got {args.video_fps}")
    model, tok = load_for_chat(args.model, args.tokenizer, device=args.device)
    processing = folder_processing(args.model, model)  # the folder's processor: 16-px patches for Qwen3-VL
    min_pixels, max_pixels = pixel_limits(args.model, processing)
    source = None
    if args.no_system or args.system is not None:
        system = None if args.no_system else args.system
    else:  # the system turn the model saw in training, said once (below) so a user can override it
        system, source = training_system(args.model)
    session = ChatSession(
        model, tok, args.image, system=system,
        min_pixels=min_pixels if args.min_pixels is None else args.min_pixels,
        max_pixels=max_pixels if args.max_pixels is None else args.max_pixels,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, videos=args.video, video_settings=video_settings(args.model, args.video_fps),
        processing=processing,
    )
    if source is not None:  # after every input was read: a bad image or config stays a one-line error
        print(f"(system prompt {describe_system(system)}: {source}; --system/--no-system to change)", file=sys.stderr)
    if args.prompt is not None:
        _answer(session, args.prompt)
    elif not sys.stdin.isatty():
        _answer(session, sys.stdin.read().strip())
    else:
        while True:
            try:
                text = input("> ").strip()
            except EOFError:
                break
            if not text:
                break
            _answer(session, text)
    return 0


def _answer(session, text: str) -> None:
    """Print the answer; an empty one also gets a line on stderr saying why (end token at once, max tokens ...)."""
    answer = session.ask(text)
    print(answer)
    why = session.why_empty(answer)
    if why:
        print(f"({why})", file=sys.stderr)
