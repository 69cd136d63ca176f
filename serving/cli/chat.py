"""`metrale chat`: a terminal chat with a running server (`--url`) or an in-process model.

Answers stream as they arrive; the whole conversation goes with every turn. Slash commands:
/reset, /system TEXT, /temp X, /save FILE, /help, /exit. Ctrl-C stops the current answer
(the server sees the client leave and frees the slot; in process, the request is cancelled)
and keeps the session. When stdin is not a terminal, each line is one message and each
answer is printed on its own line (stdout has only the answers; notes go to stderr), so the
command can be scripted; it then exits 1 if any turn failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
from collections.abc import Generator
from pathlib import Path
from typing import IO, Any, Protocol

from metrale_jax.errors import InvalidParameterError
from serving.cli.http_client import Client

PROMPT = "you> "
MAX_TEMPERATURE = 2.0
HELP = """commands:
  /reset          forget the conversation (the system prompt stays)
  /system TEXT    set the system prompt (/system alone clears it)
  /temp X         set the sampling temperature, 0 (greedy) to 2 (/temp alone shows it)
  /save FILE      write the conversation as JSON
  /help           this list
  /exit           quit (Ctrl-D too); Ctrl-C stops an answer
  //text          send a message that starts with '/'"""


class Backend(Protocol):
    """Where answers come from: `stream(...)` yields the answer's text as it is made."""

    name: str

    def stream(self, messages: list[dict[str, str]], temperature: float, max_tokens: int,
               seed: int | None) -> Generator[str, None, None]:
        """The assistant's answer to `messages`, in text deltas (close it to stop early)."""
        ...


class RemoteBackend:
    """An OpenAI-compatible server: streaming POST /v1/chat/completions."""

    def __init__(self, client: Client, model: str):
        self.client = client
        self.model = model
        self.name = f"{model} at {client.url}"

    def stream(self, messages: list[dict[str, str]], temperature: float, max_tokens: int,
               seed: int | None) -> Generator[str, None, None]:
        """Streams one answer; closing the generator drops the connection."""
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": True,
                                "temperature": temperature, "max_tokens": max_tokens}
        if seed is not None:
            body["seed"] = seed
        with self.client.stream("/v1/chat/completions", body) as events:
            for event in events:
                for choice in event.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        yield text


class LocalBackend:
    """An in-process `metrale_jax.LLM` (its `stream_chat`)."""

    def __init__(self, llm: Any, name: str):
        self.llm = llm
        self.name = f"{name} (in process)"

    def stream(self, messages: list[dict[str, str]], temperature: float, max_tokens: int,
               seed: int | None) -> Generator[str, None, None]:
        """Streams one answer; closing the generator cancels the request."""
        from metrale_jax.scheduler import SamplingParams
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
        yield from self.llm.stream_chat(messages, params)


class ChatSession:
    """The conversation and its commands, independent of the terminal.

    Args:
        backend: where answers come from.
        out: answers are written here as they stream; err: notes and errors.
        system: the system prompt; temperature, max_tokens, seed: sampling of every turn.
    Attributes:
        history: user and assistant turns (the system prompt is kept apart).
        failures: turns that ended in an error.
    """

    def __init__(self, backend: Backend, out: IO[str], err: IO[str], *,
                 system: str | None = None, temperature: float = 0.7, max_tokens: int = 512,
                 seed: int | None = None):
        self.backend = backend
        self.out = out
        self.err = err
        self.system = system
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.seed = seed
        self.history: list[dict[str, str]] = []
        self.failures = 0

    @property
    def messages(self) -> list[dict[str, str]]:
        """What is sent each turn: the system prompt (if any) and the history."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.history

    def note(self, text: str) -> None:
        """A line for the user that is not part of an answer."""
        print(text, file=self.err, flush=True)

    def handle(self, line: str) -> bool:
        """One line of input: a command or a message. False when the session should end."""
        line = line.strip()
        if not line:
            return True
        if line.startswith("//"):
            self.ask(line[1:])
            return True
        if line.startswith("/"):
            return self.command(line)
        self.ask(line)
        return True

    def command(self, line: str) -> bool:
        """Runs a slash command; a bad one prints why. False for /exit."""
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        if name in ("/exit", "/quit"):
            return False
        if name == "/help":
            self.note(HELP)
        elif name == "/reset":
            self.history.clear()
            self.note("conversation cleared")
        elif name == "/system":
            self.system = arg or None
            self.note(f"system prompt set ({len(arg)} characters)" if arg
                      else "system prompt cleared")
        elif name == "/temp":
            self._set_temperature(arg)
        elif name == "/save":
            self._save(arg)
        else:
            self.note(f"unknown command {name}; /help lists the commands")
        return True

    def _set_temperature(self, arg: str) -> None:
        if not arg:
            self.note(f"temperature {self.temperature:g}")
            return
        try:
            value = float(arg)
        except ValueError:
            self.note(f"/temp needs a number from 0 to {MAX_TEMPERATURE:g}, not {arg!r}")
            return
        if not 0.0 <= value <= MAX_TEMPERATURE:
            self.note(f"/temp needs a number from 0 to {MAX_TEMPERATURE:g}, not {arg}")
            return
        self.temperature = value
        self.note(f"temperature {value:g}")

    def _save(self, arg: str) -> None:
        if not arg:
            self.note("/save needs a file name: /save FILE")
            return
        path = Path(arg).expanduser()
        data = {"backend": self.backend.name, "system": self.system,
                "temperature": self.temperature, "max_tokens": self.max_tokens,
                "messages": self.messages}
        try:
            path.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n")
        except OSError as e:
            self.note(f"cannot write {path}: {e.strerror or e}")
            return
        self.note(f"saved {len(self.history)} messages to {path}")

    def ask(self, text: str) -> None:
        """Sends one user message and streams the answer; Ctrl-C stops it early."""
        self.history.append({"role": "user", "content": text})
        parts: list[str] = []
        stream = self.backend.stream(self.messages, self.temperature, self.max_tokens,
                                     self.seed)
        try:
            for delta in stream:
                parts.append(delta)
                self.out.write(delta)
                self.out.flush()
        except KeyboardInterrupt:
            stream.close()
            self.out.write("\n")
            self.out.flush()
            self.note("[stopped]")
            if parts:  # what was shown stays part of the conversation
                self.history.append({"role": "assistant", "content": "".join(parts)})
            else:  # stopped before any text: the turn did not happen
                self.history.pop()
            return
        except Exception as e:  # a failed turn is reported; the session goes on
            stream.close()
            if parts:
                self.out.write("\n")
            self.failures += 1
            self.history.pop()
            self.note(f"error: {getattr(e, 'message', None) or e}")
            return
        self.out.write("\n")
        self.out.flush()
        self.history.append({"role": "assistant", "content": "".join(parts)})


def run_session(session: ChatSession, stdin: IO[str], interactive: bool) -> int:
    """Reads lines until /exit or end of input; returns the exit code."""
    if interactive:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401 (line editing and history for input())
        session.note(f"metrale chat: {session.backend.name}. /help for commands, "
                     "Ctrl-C stops an answer, /exit or Ctrl-D quits")
    while True:
        try:
            line = input(PROMPT) if interactive else stdin.readline()
        except EOFError:
            break
        except KeyboardInterrupt:
            if not interactive:
                return 130
            print(file=session.err)
            session.note("(Ctrl-C stops an answer; /exit or Ctrl-D quits)")
            continue
        if not interactive and not line:
            break
        if not session.handle(line):
            break
    if interactive:
        print(file=session.err)
    return 1 if session.failures and not interactive else 0


def _local_backend(args: argparse.Namespace) -> LocalBackend:
    from metrale_jax import LLM
    from serving.progress import StageProgress, stage
    with StageProgress() as progress:
        with stage(progress, "loading weights"):
            llm = LLM(args.model, dtype=args.dtype, max_slots=1, max_len=args.max_len)
        with stage(progress, "starting the engine"):
            # builds the engine; each program compiles on the first message that needs it
            llm.scheduler  # noqa: B018
    return LocalBackend(llm, args.model)


def cmd_chat(args: argparse.Namespace) -> int:
    """Runs the chat until /exit or end of input."""
    if not 0.0 <= args.temperature <= MAX_TEMPERATURE:
        raise InvalidParameterError(f"--temperature must be from 0 to {MAX_TEMPERATURE:g}")
    if args.max_tokens < 1:
        raise InvalidParameterError("--max-tokens must be ≥ 1")
    if args.url and args.model:
        raise InvalidParameterError("give --url (a server) or --model (in process), not both")
    # Ctrl-C stops an answer: Python turns SIGINT into KeyboardInterrupt only when the parent
    # did not ignore it, and a job started in the background by a shell script inherits it
    # ignored; the chat asks for it back.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    backend: Backend
    if args.url:
        client = Client(args.url, api_key=args.api_key, timeout=args.timeout)
        backend = RemoteBackend(client, args.model_id or client.first_model())
    else:
        args.model = args.model or "default"
        backend = _local_backend(args)
    session = ChatSession(backend, sys.stdout, sys.stderr, system=args.system,
                          temperature=args.temperature, max_tokens=args.max_tokens,
                          seed=args.seed)
    try:
        return run_session(session, sys.stdin, sys.stdin.isatty())
    finally:
        if isinstance(backend, LocalBackend):
            backend.llm.close()


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Registers `metrale chat`."""
    p = sub.add_parser(
        "chat", help="chat in the terminal with a server or an in-process model",
        description="Chat in the terminal with a running server (--url, the OpenAI\n"
                    "/v1/chat/completions API, streaming) or with a model loaded in this\n"
                    "process (--model). Answers stream; the conversation is kept between\n"
                    "turns. Ctrl-C stops an answer. With stdin not a terminal, each line is\n"
                    "one message and each answer is printed on its own line.",
        epilog=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None,
                   help="base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None,
                   help="run this model in process: 'default', a checkpoint path or a Hugging "
                        "Face name org/repo[:QUANT][@revision] (the "
                        "default when --url is not given)")
    p.add_argument("--model-id", default=None,
                   help="with --url: the model id to ask for (default: the first the server "
                        "lists)")
    p.add_argument("--api-key", default=None, help="with --url: sent as 'Bearer KEY'")
    p.add_argument("--system", default=None, help="the system prompt")
    p.add_argument("--temperature", type=float, default=0.7,
                   help="sampling temperature, 0 (greedy) to 2 (default 0.7)")
    p.add_argument("--max-tokens", type=int, default=512,
                   help="most tokens per answer (default 512)")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling")
    p.add_argument("--max-len", type=int, default=2048,
                   help="with --model: context length of the engine (default 2048)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="with --model: params and compute dtype (default float32)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="with --url: seconds to wait for the server (default 600)")
    p.set_defaults(func=cmd_chat)
