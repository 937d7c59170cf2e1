"""``met serve`` and the text side of ``met run``: prompts as text, streamed text out.

``met run DIR --prompt "text"`` (a checkpoint with ``tokenizer.json``) streams the decoded
text; ``--chat`` renders the prompt through the chat template; ``--prompt-ids 1,2,3`` gives
token ids instead (printed as ids when the checkpoint has no tokenizer).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from metrale.cli import command
from metrale.lkb.errors import ConfigError
from metrale.terminal import int_at_least


def sampling_args(p: argparse.ArgumentParser) -> None:
    """The text and sampling flags ``met run`` takes."""
    p.add_argument("--prompt-ids", default=None,
                   help="comma-separated token ids (instead of --prompt's text)")
    p.add_argument("--chat", action="store_true",
                   help="render --prompt as a user message through the chat template")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="tokens to generate (default: --steps)")
    p.add_argument("--temperature", type=float, default=None,
                   help="0 is greedy (default: generation_config.json's, else greedy)")
    p.add_argument("--top-k", type=int, default=None, help="keep the k largest logits (0: off)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus mass (1: off)")
    p.add_argument("--min-p", type=float, default=None,
                   help="keep tokens with probability >= min-p × the largest (0: off)")
    p.add_argument("--stop", action="append", default=[],
                   help="stop before this text (repeatable)")


def wants_text(args: argparse.Namespace) -> bool:
    """Whether ``met run`` goes the text way: a checkpoint with a tokenizer and no
    ``--prompt-ids``, or ``--chat``."""
    if args.chat:
        return True
    if args.prompt_ids is not None:
        return False
    return (Path(args.checkpoint or args.model) / "tokenizer.json").is_file()


def run_text(args: argparse.Namespace) -> int:
    """``met run`` with a text prompt: stream the text, then one line of figures."""
    from metrale.runtime.generate import resolve_sampling
    from metrale.runtime.parallel import load_engine
    from metrale.runtime.sampling import Sampling

    source = args.checkpoint or args.model
    max_tokens = args.max_tokens if args.max_tokens is not None else args.steps
    t0 = time.perf_counter()
    with load_engine(source, args.tp, hardware=args.hardware, quant=args.quant, act=args.act,
                     max_ctx=args.context, seed=args.seed, blocking=args.blocking,
                     policy=args.policy) as eng:
        if eng.text is None:
            raise ConfigError("a text prompt needs the checkpoint's tokenizer", key="--prompt",
                              expected="a checkpoint directory with tokenizer.json, or "
                                       "--prompt-ids")
        base = resolve_sampling(eng, None)
        sampling = Sampling.from_defaults(
            None, temperature=base.temperature if args.temperature is None else args.temperature,
            top_k=base.top_k if args.top_k is None else args.top_k,
            top_p=base.top_p if args.top_p is None else args.top_p,
            min_p=base.min_p if args.min_p is None else args.min_p, seed=args.seed)
        load_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        first = None
        n = 0
        finish = None
        for delta in eng.stream(args.prompt, max_tokens, sampling=sampling,
                                stop=tuple(args.stop), chat=args.chat):
            first = first or time.perf_counter()
            n += len(delta.ids)
            finish = delta.finish
            sys.stdout.write(delta.text)
            sys.stdout.flush()
        done = time.perf_counter()
    sys.stdout.write("\n")
    ttft = (first - t1) if first else float("nan")
    rate = (n - 1) / (done - first) if first and n > 1 else float("nan")
    print(f"[{n} tokens, finish {finish}; loaded in {load_s:.2f} s, first token in "
          f"{ttft * 1e3:.1f} ms, {rate:.1f} tokens/s]", file=sys.stderr)
    return 0


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a checkpoint directory (or a built-in name: ids only)")
    p.add_argument("--hardware", default="host", help="the hardware class to run on")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind: loopback keeps the server on this machine")
    p.add_argument("--port", type=int_at_least(0, 65535), default=8000, help="TCP port to bind")
    p.add_argument("--name", default=None, help="the model id clients ask for "
                                                "(default: the directory's name)")
    p.add_argument("--slots", type=int_at_least(1), default=8,
                   help="KV slots: requests served at once (more get 429)")
    p.add_argument("--context", type=int_at_least(1), default=1024, help="positions per slot")
    p.add_argument("--act", choices=("bf16", "f32"), default="bf16", help="activation dtype")
    p.add_argument("--quant", default=None, help="weight format (default: the checkpoint's)")
    p.add_argument("--policy", choices=("exact", "bounded"), default="exact",
                   help="numerics: exact plans give a request the same tokens alone or batched")
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug", "trace"),
                   help="uvicorn's log level")
    from metrale.commands import tp_arg

    tp_arg(p)


@command("serve", "serve a model over an OpenAI-compatible HTTP API (completions, chat, "
                  "streaming), batching concurrent requests")(_serve_args)
def serve_command(args: argparse.Namespace) -> int:
    from metrale.runtime.parallel import load_engine
    from metrale.serve import listen, serve

    if not 0 < args.port < 65536:
        raise ConfigError("bad port", key="--port", expected="1..65535", found=args.port)
    with listen(args.host, args.port) as sock:  # a bad address fails before the model loads
        eng = load_engine(args.model, args.tp, hardware=args.hardware, quant=args.quant,
                          act=args.act, max_ctx=args.context, slots=args.slots,
                          policy=args.policy)
        name = args.name or Path(str(args.model)).name
        print(f"met serve: {name} ({eng.quant}, act {eng.act}, {eng.slots} slots × "
              f"{eng.max_ctx} positions) on http://{args.host}:{args.port}", file=sys.stderr)
        serve(eng, name, host=args.host, port=args.port, log_level=args.log_level, sock=sock)
    return 0
