"""The sampling flags of `metrale generate`: every `SamplingParams` control as a flag (the
numeric ones from `metrale_jax.sampling_fields.SPELLINGS`, the list-valued ones here)."""

from __future__ import annotations

import argparse
import json

from metrale_jax.errors import InvalidParameterError
from metrale_jax.sampling_fields import FIELD, SAME, spellings
from metrale_jax.scheduler import SamplingParams

_TYPES = {"number": float, "integer": int}


def _flags() -> list[tuple[str, type, object, str]]:
    """(flag, type, default, help) of each CLI spelling in `sampling_fields.SPELLINGS`; the
    default is the spelling's own (temperature: greedy) else the field's."""
    out = []
    for s in spellings("cli"):
        f = FIELD[s.field]
        default = f.default if s.default is SAME else s.default
        out.append((s.name, _TYPES[f.kind], default, f.doc))
    return out


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    """Adds every sampling control to `parser` (defaults: greedy, everything off)."""
    group = parser.add_argument_group("sampling")
    for flag, kind, default, text in _flags():
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
    fields = {s.field: getattr(args, s.name[2:].replace("-", "_")) for s in spellings("cli")}
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
