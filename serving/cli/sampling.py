"""The sampling flags of `metrale generate`: every `SamplingParams` control as a flag."""

from __future__ import annotations

import argparse
import json

from metrale_jax.errors import InvalidParameterError
from metrale_jax.scheduler import SamplingParams

# (flag, type, default, help); the SamplingParams field is the flag with "_" for "-".
_FLAGS: list[tuple[str, type, object, str]] = [
    ("--temperature", float, 0.0, "0 = greedy"),
    ("--top-k", int, 0, "keep the k most likely tokens (0 = off)"),
    ("--top-p", float, 1.0, "nucleus sampling mass (1 = off)"),
    ("--min-p", float, 0.0, "drop tokens below min_p * p(most likely) (0 = off)"),
    ("--typical-p", float, 1.0, "locally typical sampling mass (1 = off)"),
    ("--top-n-sigma", float, 0.0, "keep logits within n standard deviations of the top "
                                  "(0 = off)"),
    ("--xtc-threshold", float, 0.1, "XTC: tokens at or above this probability are excluded"),
    ("--xtc-probability", float, 0.0, "XTC: chance per step to exclude them (0 = off)"),
    ("--repetition-penalty", float, 1.0, "divide/multiply logits of seen tokens (1 = off)"),
    ("--presence-penalty", float, 0.0, "OpenAI presence penalty in [-2, 2]"),
    ("--frequency-penalty", float, 0.0, "OpenAI frequency penalty in [-2, 2]"),
    ("--dry-multiplier", float, 0.0, "DRY penalty strength (0 = off)"),
    ("--dry-base", float, 1.75, "DRY exponential base"),
    ("--dry-allowed-length", int, 2, "DRY: repeats up to this length are free"),
    ("--dry-penalty-last-n", int, -1, "DRY: tokens to scan (-1 = whole context, 0 = off)"),
    ("--lz-penalty", float, 0.0, "LZ penalty strength (0 = off)"),
    ("--min-tokens", int, 0, "eos and stop ids are masked until this many tokens"),
    ("--seed", int, None, "seed for sampling"),
    ("--num-beams", int, 1, "beam search over this many beams (1 = off; transformers' "
                            "num_beams; prints the best hypothesis)"),
    ("--length-penalty", float, 1.0, "beam search: score = logprob sum / length ** this"),
]


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    """Adds every sampling control to `parser` (defaults: greedy, everything off)."""
    group = parser.add_argument_group("sampling")
    for flag, kind, default, text in _FLAGS:
        group.add_argument(flag, type=kind, default=default, help=text)
    group.add_argument("--dry-sequence-breaker", action="append", default=None,
                       metavar="TEXT", help="a DRY sequence breaker (repeatable; default "
                                            "newline, ':', '\"', '*')")
    group.add_argument("--stop", action="append", default=[], metavar="TEXT",
                       help="a stop string (repeatable)")
    group.add_argument("--bad-word", action="append", default=[], metavar="TEXT",
                       help="a string never to generate (repeatable)")
    group.add_argument("--logit-bias", default=None, metavar="JSON",
                       help='token id -> bias in [-100, 100], e.g. \'{"42": -100}\'')
    group.add_argument("--ignore-eos", action="store_true", help="keep going past eos")
    group.add_argument("--repetition-detection", action="store_true",
                       help="stop when the output tail is one block repeated")
    group.add_argument("--early-stopping", default="false", choices=["true", "false", "never"],
                       help="beam search: when to stop (transformers' meanings)")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    """The `SamplingParams` the flags ask for (raises `InvalidParameterError`)."""
    bias = {}
    if args.logit_bias:
        try:
            bias = json.loads(args.logit_bias)
        except json.JSONDecodeError as e:
            raise InvalidParameterError(f"--logit-bias is not valid JSON: {e}",
                                        param="logit_bias") from None
        if not isinstance(bias, dict):
            raise InvalidParameterError("--logit-bias must be a JSON object",
                                        param="logit_bias")
    fields = {flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_"))
              for flag, *_ in _FLAGS}
    if args.dry_sequence_breaker is not None:
        fields["dry_sequence_breakers"] = tuple(args.dry_sequence_breaker)
    return SamplingParams(max_tokens=args.max_tokens, stop=tuple(args.stop),
                          bad_words=tuple(args.bad_word), logit_bias=bias,
                          ignore_eos=args.ignore_eos,
                          repetition_detection=args.repetition_detection or None,
                          early_stopping={"true": True, "false": False}.get(
                              args.early_stopping, args.early_stopping), **fields)


def add_logprobs_mode_flag(parser: argparse.ArgumentParser) -> None:
    """Adds --logprobs-mode (raw or processed logprobs) to `generate` and `serve`."""
    parser.add_argument("--logprobs-mode", default="raw", choices=["raw", "processed"],
                        help="logprobs of the model's raw log-softmax (default, as vLLM) or of "
                             "the processed distribution actually sampled from")
