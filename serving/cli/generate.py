"""`metrale generate`: one prompt through `metrale_jax.LLM` in this process, streamed to stdout
(or one JSON Completion); on several hosts every process runs it and process 0 prints.

On a translation model (NLLB / M2M100) the prompt is the text to translate from
`--source-lang` into `--target-lang` (FLORES-200 codes); the sampling and beam search flags
apply, and the translation is printed once complete."""

from __future__ import annotations

import argparse
import json
import os
import sys

from metrale_jax.errors import InvalidParameterError
from serving.cli.languages import add_language_flags, source_len_option, translation_model
from serving.cli.sampling import (
    add_logprobs_mode_flag,
    add_sampling_flags,
    sampling_params_from_args,
)
from serving.cli.scale import (
    add_kv_cache_flag,
    add_quantization_flag,
    add_scale_flags,
    engine_options,
    init_distributed,
    shape_flag,
)

DEMO_PROMPT = "What is the capital of France? Answer in one sentence."


def cmd_generate(args: argparse.Namespace) -> int:
    """Generates from one prompt, streaming text to stdout (or one JSON Completion)."""
    import dataclasses

    from metrale_jax import LLM
    params = sampling_params_from_args(args)
    pid, processes = init_distributed(args)
    translating = translation_model(args.model, args.source_lang, args.target_lang)
    if translating and args.chat:
        raise InvalidParameterError(
            f"--chat is for chat models; {args.model!r} is a translation model: give the text "
            "to translate as --prompt, with --source-lang and --target-lang", param="chat")
    for code, flag in ((args.source_lang, "--source-lang"), (args.target_lang, "--target-lang")):
        if translating and code is None:
            raise InvalidParameterError(f"{flag} is required: {args.model!r} is a translation "
                                        "model", param=flag[2:].replace("-", "_"))
    if processes > 1:  # every process runs the same generation: the same seed on each
        params = dataclasses.replace(params, seed=0 if params.seed is None else params.seed)
        if pid != 0:  # only process 0 prints
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the process's lifetime)
    llm = LLM(args.model, dtype=args.dtype, max_slots=params.num_beams,
              max_len=shape_flag(args.max_len),
              logprobs_mode=args.logprobs_mode, **engine_options(args),
              **source_len_option(args))
    try:
        if translating:
            out = llm.translate(args.prompt, args.source_lang, args.target_lang, params)[0]
            print(json.dumps(out.to_dict()) if args.json else out.text)
            return 0
        if args.chat:
            messages = [{"role": "user", "content": args.prompt}]
            if args.json:
                print(json.dumps(llm.chat(messages, params).to_dict()))
                return 0
            stream = llm.stream_chat(messages, params)
        else:
            if args.json:
                print(json.dumps(llm.generate([args.prompt], params)[0].to_dict()))
                return 0
            stream = llm.stream(args.prompt, params)
        for delta in stream:
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
    finally:
        llm.close()
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Registers `metrale generate`."""
    gen = sub.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("--model", default="default", help="'default', a checkpoint path, or a "
                     "Hugging Face name org/repo[:QUANT][@revision]")
    gen.add_argument("--prompt", default=DEMO_PROMPT, help="the prompt text")
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    gen.add_argument("--max-len", type=int, default=2048, help="context length (cache size)")
    gen.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                     help="params and compute dtype (default float32, or an orbax "
                          "checkpoint's stored dtype)")
    add_quantization_flag(gen)
    add_kv_cache_flag(gen)
    gen.add_argument("--json", action="store_true", help="print the Completion as JSON")
    add_language_flags(gen, defaults=False)
    add_scale_flags(gen)
    add_logprobs_mode_flag(gen)
    add_sampling_flags(gen)
    gen.set_defaults(func=cmd_generate)
