"""``llmkit generate``: text from a trained run, batched, streamed or interactive; with
``--chat``, replies of a chat model (its run's chat template), one message or a
conversation read line by line."""

from __future__ import annotations

import argparse
import codecs
import dataclasses
import json
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

from llmkit.cli.common import QUANTIZE, QUANTIZE_HELP, WEIGHTS, seed, write
from llmkit.errors import LlmkitError


def register_commands(register: Callable[..., Any]) -> None:
    register(
        "generate",
        run_generate,
        help="generate text from a trained run",
        configure=configure_generate,
    )


def configure_generate(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="run directory or checkpoint directory")
    p.add_argument(
        "--prompt",
        action="append",
        help="text to continue (repeat for a batch; default: a new document)",
    )
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely")
    p.add_argument("--top-p", type=float, default=None, help="nucleus: smallest set of mass p")
    p.add_argument(
        "--min-p", type=float, default=None, help="drop tokens below min-p × the top probability"
    )
    p.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeated tokens"
    )
    p.add_argument("--num-beams", type=int, default=1, help="> 1: beam search (deterministic)")
    p.add_argument(
        "--length-penalty", type=float, default=1.0, help="beam score = log p / length**this"
    )
    p.add_argument(
        "--no-early-stopping",
        action="store_true",
        help="beam search: go on while a running beam can still win",
    )
    p.add_argument(
        "--stop", action="append", metavar="TEXT", help="stop at this text (repeatable; \\n ok)"
    )
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the EOS token")
    p.add_argument("--seed", type=seed, default=None)
    p.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    p.add_argument(
        "--interactive", action="store_true", help="read prompts from stdin until EOF or `exit`"
    )
    p.add_argument(
        "--chat",
        nargs="?",
        const="",
        metavar="MESSAGE",
        help="reply to MESSAGE as the run's chat model (its chat template; stops at the end "
        "of the turn); without MESSAGE, a conversation: one user turn per line of stdin",
    )
    p.add_argument("--system", metavar="TEXT", help="--chat: a system message first")
    p.add_argument(
        "--quantize",
        choices=QUANTIZE,
        help=QUANTIZE_HELP,
    )
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, mps or auto")
    p.add_argument("--json", action="store_true", help="print text, ids and finish reasons")
    p.add_argument("--weights", choices=WEIGHTS, default="final")


def complete(run: Any, prompt: str, sampling: Any) -> str:
    """The continuation of ``prompt``. An empty prompt starts from the document separator
    and, unless ``sampling.eos_id`` is set, runs across documents (EOS does not stop it)."""
    from llmkit.inference import Generator

    if not prompt and sampling.eos_id is None:
        sampling = dataclasses.replace(sampling, ignore_eos=True)
    return Generator(run).generate(prompt, sampling)[0].text


def sampling_from_args(args: argparse.Namespace) -> Any:
    """The ``Sampling`` the flags ask for; an impossible combination is a user error."""
    from llmkit.inference import Sampling

    beams = args.num_beams > 1
    sampling = Sampling(
        max_new_tokens=args.max_new_tokens,
        temperature=0.0 if beams else args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        stop=tuple(s.replace("\\n", "\n").replace("\\t", "\t") for s in args.stop or ()),
        num_beams=args.num_beams,
        length_penalty=args.length_penalty,
        early_stopping=not args.no_early_stopping,
    )
    try:
        # beam search decodes without a temperature; a --temperature given is checked still
        dataclasses.replace(sampling, temperature=args.temperature).validate()
        sampling.validate()
    except ValueError as exc:
        raise LlmkitError(str(exc)) from exc
    return sampling


def _stream_one(gen: Any, prompt: str, sampling: Any) -> Any:
    stream = gen.stream(prompt, sampling)
    for piece in stream:
        write(piece)
    return stream.result


def _input_lines(banner: str, prompt: str) -> Iterator[str]:
    """Lines of stdin without their line end, until EOF or `exit`/`quit`; on a terminal
    with ``banner`` first and ``prompt`` before each. A line that is not UTF-8 ends the
    command with a one-line error naming it."""
    tty = sys.stdin.isatty()
    if tty:
        sys.stderr.write(f"{banner}; `exit` or Ctrl-D ends\n")
    number = 0
    while True:
        if tty:
            sys.stderr.write(prompt)
            sys.stderr.flush()
        number += 1
        line = _read_line(number)
        if not line:
            return
        text = _text(line.rstrip("\r\n"), f"stdin line {number}")
        if text.strip() in ("exit", "quit"):
            return
        yield text


def _read_line(number: int) -> str:
    """Line ``number`` of stdin ('' at the end). Read as bytes and decoded here, one line at
    a time (a text stream decodes a whole buffer at once: its error would name no line);
    bytes that are not in stdin's encoding are a one-line error naming the line."""
    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is None:  # a text stream without bytes underneath (io.StringIO)
        return sys.stdin.readline()
    raw = buffer.readline()
    encoding = getattr(sys.stdin, "encoding", None) or "utf-8"
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as exc:
        name = "UTF-8" if codecs.lookup(encoding).name == "utf-8" else encoding
        raise LlmkitError(
            f"stdin line {number}: not valid {name} (byte 0x{raw[exc.start]:02x} at byte "
            f"{exc.start}: {exc.reason})"
        ) from None


def note_unknown(tokenizer: Any, text: str, where: str) -> None:
    """Say in one line (``note: …``) how many characters of ``text`` the tokenizer does not
    know (they become ``<unk>``, which a char tokenizer's model never learned to read)."""
    if not text or not hasattr(tokenizer, "unknown_note"):
        return
    note = tokenizer.unknown_note(tokenizer.encode(text), where)
    if note:
        logging.getLogger("llmkit").info(note)


def _record(result: Any, **first: Any) -> dict[str, Any]:
    """One generation as ``--json`` prints it: ``first``, then the text, ids, finish
    reason and score."""
    return {
        **first,
        "text": result.text,
        "ids": result.ids,
        "finish_reason": result.finish_reason,
        "score": result.score,
    }


def _reply_record(result: Any, **first: Any) -> dict[str, Any]:
    """One chat reply as ``--json`` prints it: ``first``, then the reply, ids and finish
    reason."""
    return {**first, "reply": result.text, "ids": result.ids, "finish_reason": result.finish_reason}


def _write_json(obj: Any) -> None:
    write(json.dumps(obj, ensure_ascii=False) + "\n")


def _interactive(gen: Any, sampling: Any, stream: bool, as_json: bool = False) -> int:
    """One prompt per line (each continued on its own) until EOF or `exit`; with
    ``as_json`` one JSON object a line (JSON Lines)."""
    for prompt in _input_lines("llmkit generate: one prompt per line", "> "):
        note_unknown(gen.tokenizer, prompt, "the prompt")
        if as_json:
            _write_json(_record(gen.generate(prompt, sampling)[0], prompt=prompt))
            continue
        if stream and sampling.num_beams == 1:
            _stream_one(gen, prompt, sampling)
        else:
            write(gen.generate(prompt, sampling)[0].text)
        write("\n")
    return 0


def chat_reply(gen: Any, messages: list[dict[str, str]], sampling: Any, stream: bool) -> Any:
    """The assistant's reply to ``messages`` (a :class:`GenerationResult`), printed as it
    comes with ``stream``; its text without the spaces around it."""
    if not (stream and sampling.num_beams == 1):
        return gen.chat(messages, sampling)
    started = False
    stream_ = gen.stream(gen.chat_prompt(messages), sampling)
    for piece in stream_:
        if not started:
            piece = piece.lstrip()
            started = bool(piece)
        write(piece)
    write("\n")
    result = stream_.result
    return dataclasses.replace(result, text=result.text.strip())


def _chat(gen: Any, args: argparse.Namespace, sampling: Any, where: str) -> int:
    """``--chat``: one reply to the message given, or a conversation from stdin (one user
    turn per line until EOF or `exit`), each reply joining the history."""
    tokenizer = gen.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise LlmkitError(
            f"{where}: the run has no chat template (tokenizer_config.json); train it on chat "
            "data (data.source.name = 'chat') or use --prompt"
        )
    sampling = gen.chat_sampling(sampling)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    stream = args.stream and not args.json
    if args.chat:
        note_unknown(tokenizer, args.chat, "the message")
        messages.append({"role": "user", "content": args.chat})
        result = chat_reply(gen, messages, sampling, stream)
        if args.json:
            _write_json(_reply_record(result, messages=messages))
        elif not stream:
            write(result.text + "\n")
        return 0
    for text in _input_lines("llmkit generate --chat: one message per line", "you> "):
        if not text.strip():
            continue
        note_unknown(tokenizer, text, "the message")
        messages.append({"role": "user", "content": text})
        result = chat_reply(gen, messages, sampling, stream)
        if args.json:  # JSON Lines: one object a turn
            _write_json(_reply_record(result, message=text))
        elif not stream:
            write(result.text + "\n")
        messages.append({"role": "assistant", "content": result.text})
    return 0


def _text(text: str, where: str) -> str:
    """``text`` when it is valid text; a one-line error naming ``where`` when it holds bytes
    that are not UTF-8 (Python escapes them as lone surrogates in arguments, and in stdin
    under the C locale)."""
    from llmkit.inference.checks import text_problem

    problem = text_problem(text)
    if problem is not None:
        raise LlmkitError(f"{where}: {problem}")
    return text


def _check_text_args(args: argparse.Namespace) -> None:
    """Refuse ``--prompt``, ``--chat``, ``--system`` and ``--stop`` values that are not
    valid UTF-8, before the run is loaded."""
    prompts = args.prompt or []
    for i, prompt in enumerate(prompts):
        _text(prompt, f"--prompt {i + 1}" if len(prompts) > 1 else "--prompt")
    for flag in ("chat", "system"):
        value = getattr(args, flag)
        if value:
            _text(value, f"--{flag}")
    for text in args.stop or ():
        _text(text, "--stop")


def run_generate(args: argparse.Namespace) -> int:
    from llmkit import hardware
    from llmkit.inference import Generator, prepare_for_decoding
    from llmkit.runs import load_run

    _check_text_args(args)
    sampling = sampling_from_args(args)
    if args.chat is not None and (args.prompt or args.interactive):
        raise LlmkitError("--chat takes the place of --prompt and --interactive; use one")
    if args.system is not None and args.chat is None:
        raise LlmkitError("--system goes with --chat")
    device = hardware.choose_device(args.device)
    run = load_run(args.run, which=args.weights, device=str(device))
    try:
        gen = Generator(run, quantize=args.quantize)
    except ValueError as exc:
        raise LlmkitError(str(exc)) from exc
    prepare_for_decoding(gen.model)  # the model is this command's own (docs/generation.md)
    if args.chat is not None:
        return _chat(gen, args, sampling, str(run.run_dir))
    if args.interactive:
        return _interactive(gen, sampling, args.stream, args.json)
    prompts = args.prompt or [""]
    for i, prompt in enumerate(prompts):
        note_unknown(gen.tokenizer, prompt, f"prompt {i + 1}" if len(prompts) > 1 else "the prompt")
    if args.stream and sampling.num_beams > 1:
        raise LlmkitError("--stream needs sampling or greedy decoding (--num-beams 1)")
    if args.stream and not args.json:
        for i, prompt in enumerate(prompts):
            if i:
                write("\n")
            write(prompt)
            _stream_one(gen, prompt, sampling)
            write("\n")
        return 0
    results = gen.generate(prompts, sampling)
    if args.json:
        out = [_record(r, prompt=p) for p, r in zip(prompts, results)]
        _write_json(out if len(out) > 1 else out[0])
        return 0
    for i, (prompt, r) in enumerate(zip(prompts, results)):
        if i:
            write("\n")
        write(prompt + r.text + "\n")
    return 0
