"""`pdserve generate`: one request to a router, its text streamed to stdout as it arrives.

Owns the command line of the client and the printing of a response stream (`--json`:
one object at the end instead). With `--auth-token-file` (or `$PDSERVE_AUTH_TOKEN`) every
call carries `authorization: Bearer <token>`. On a failed call it prints the gRPC status name and
message to stderr and exits 1; Ctrl-C cancels the stream (the router frees what the request
held), ends the line and exits 130. It never talks to a node directly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from typing import TextIO

import grpc
import uvloop

from pdserve.common.auth import add_auth_args, open_channel, token_or_usage_error
from pdserve.common.tls import TlsConfig, add_tls_args, tls_or_usage_error
from pdserve.common.lifecycle import ExitStatus
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.proto.convert import finish_reason_name

DEFAULT_ADDRESS = "127.0.0.1:50051"


@dataclass
class Completion:
    """One sample's responses, accumulated."""

    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    prompt_logprobs: list[dict] = field(default_factory=list)  # entry j: prompt token j+1
    last: pdserve_pb2.GenerateResponse | None = None

    def add(self, response: pdserve_pb2.GenerateResponse) -> None:
        self.request_id = response.request_id
        self.text += response.text
        self.token_ids.extend(response.token_ids)
        self.logprobs.extend(_logprobs_dict(lp) for lp in response.logprobs)
        self.prompt_logprobs.extend(_logprobs_dict(lp) for lp in response.prompt_logprobs)
        if response.finish_reason != pdserve_pb2.FINISH_REASON_UNSPECIFIED:
            self.last = response

    def as_dict(self) -> dict:
        last = self.last or pdserve_pb2.GenerateResponse()
        out = {
            "request_id": self.request_id,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": finish_reason_name(last.finish_reason),
            "stop_string": last.stop_string or None,
            "stop_token_id": last.stop_token_id if last.stop_token_id >= 0 else None,
            "usage": _fields(last.usage),
            "timings": _fields(last.timings),
        }
        if self.logprobs:
            out["logprobs"] = self.logprobs
        if self.prompt_logprobs:
            out["prompt_logprobs"] = self.prompt_logprobs
        return out


def build_request(args: argparse.Namespace) -> pdserve_pb2.GenerateRequest:
    params = pdserve_pb2.SamplingParams(stop=args.stop, ignore_eos=args.ignore_eos)
    for name in ("max_tokens", "temperature", "seed", "top_p", "top_k", "logprobs", "prompt_logprobs"):
        value = getattr(args, name)
        if value is not None:
            setattr(params, name, value)
    constraint = _structured_output(args)
    if constraint is not None:
        params.structured_output.CopyFrom(constraint)
    request = pdserve_pb2.GenerateRequest(sampling_params=params)
    if args.token_ids is not None:
        request.token_ids.ids.extend(args.token_ids)
    else:
        request.text = args.prompt
    return request


async def generate(
    address: str, request: pdserve_pb2.GenerateRequest, out: TextIO | None, timeout_s: float | None = None,
    token: str | None = None, tls: TlsConfig | None = None,
) -> Completion:
    """Stream one request's text to `out` (when given) and return what came back."""
    completion = Completion()
    async with open_channel(address, token, tls=tls) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        async for response in stub.Generate(request, timeout=timeout_s):
            completion.add(response)
            if out is not None and response.text:
                out.write(response.text)
                out.flush()
    return completion


async def _run(args: argparse.Namespace, token: str | None, tls: TlsConfig | None) -> int:
    request = build_request(args)
    try:
        completion = await generate(args.addr, request, None if args.json else sys.stdout, args.timeout_s, token,
                                    tls)
    except grpc.aio.AioRpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        if exc.code() is grpc.StatusCode.UNAVAILABLE and tls is not None and not tls.has_identity:
            # The handshake failure says only "Socket closed": name the likely cause.
            print("(under mutual TLS the router's gRPC port requires a client certificate the CA signed: "
                  "--tls-cert-file and --tls-key-file)", file=sys.stderr)
        return ExitStatus.FAILED
    if args.json:
        print(json.dumps(completion.as_dict()))
    else:
        print()
    return ExitStatus.OK


def _structured_output(args: argparse.Namespace) -> pdserve_pb2.StructuredOutput | None:
    if args.json_object:
        return pdserve_pb2.StructuredOutput(json_object=True)
    if args.choice:
        return pdserve_pb2.StructuredOutput(choice=pdserve_pb2.Choices(options=args.choice))
    for name in ("json_schema", "regex", "grammar"):
        if getattr(args, name) is not None:
            return pdserve_pb2.StructuredOutput(**{name: getattr(args, name)})
    return None


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--token-ids must be comma-separated integers, got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve generate", description="generate text through a pdserve router")
    parser.add_argument("prompt", nargs="?", help="prompt text (or use --token-ids)")
    parser.add_argument("--addr", default=DEFAULT_ADDRESS, help="router HOST:PORT")
    parser.add_argument("--token-ids", type=_token_ids, help="prompt as token ids, e.g. 1,2,3")
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--logprobs", type=int, help="top logprobs per token")
    parser.add_argument("--prompt-logprobs", type=int,
                        help="score every prompt token after the first, with this many top alternatives (--json)")
    constrain = parser.add_mutually_exclusive_group()
    constrain.add_argument("--json-schema", help="the output is JSON valid under this schema (JSON text)")
    constrain.add_argument("--json-object", action="store_true", help="the output is a JSON object or array")
    constrain.add_argument("--regex", help="the output matches this regular expression")
    constrain.add_argument("--choice", action="append", help="the output is one of these strings (repeatable)")
    constrain.add_argument("--grammar", help="the output follows this EBNF grammar (start rule `root`)")
    parser.add_argument("--timeout-s", type=float, help="deadline of the whole request")
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    add_auth_args(parser)
    add_tls_args(parser, server=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if (args.prompt is None) == (args.token_ids is None):
        parser.error("give exactly one of PROMPT and --token-ids")
    token = token_or_usage_error(parser, args.auth_token_file, os.environ)
    try:
        return uvloop.run(_run(args, token, tls_or_usage_error(parser, args, server=False)))
    except KeyboardInterrupt:  # the run cancelled the call on its way out
        if not args.json:
            print()  # the streamed text ends its line, as a finished one does
        return ExitStatus.INTERRUPTED


def _logprobs_dict(lp: pdserve_pb2.TokenLogprobs) -> dict:
    return {"token_id": lp.token_id, "logprob": lp.logprob, "top": [[t.token_id, t.logprob] for t in lp.top]}


def _fields(message) -> dict:
    return {f.name: getattr(message, f.name) for f in message.DESCRIPTOR.fields}


if __name__ == "__main__":
    sys.exit(main())
