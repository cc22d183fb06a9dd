"""The `openai` Python client against a running `thin serve` (tests/serve.rs runs this).

equal: a non-streamed and a streamed chat completion (greedy) whose text, finish reason and usage
       equal `thin run --chat`'s (given as JSON by --expect); /v1/models; errors as the client's
       typed exceptions.
load:  --requests requests from --clients threads; each is answered 200 or 429 (none lost or
       failed otherwise), and the server's resident memory (/proc/PID/status) stays flat.
"""

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import openai


def client(args, retries=0):
    return openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=retries, timeout=120)


def equal(args):
    want = json.load(open(args.expect))
    c = client(args)
    messages = [{"role": "user", "content": args.prompt}]
    r = c.chat.completions.create(model=args.model, messages=messages, max_tokens=args.max_tokens, temperature=0)
    got = (r.choices[0].message.content, r.choices[0].finish_reason, r.usage.prompt_tokens, r.usage.completion_tokens)
    expected = (want["text"], want["finish_reason"], want["prompt_tokens"], want["completion_tokens"])
    assert got == expected, f"non-streamed: {got!r} != {expected!r}"
    assert r.choices[0].message.role == "assistant" and r.object == "chat.completion" and r.model == args.model

    pieces, finish, usage = [], None, None
    stream = c.chat.completions.create(
        model=args.model, messages=messages, max_tokens=args.max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    got = ("".join(pieces), finish, usage.prompt_tokens, usage.completion_tokens)
    assert got == expected, f"streamed: {got!r} != {expected!r}"
    assert len(pieces) > 3, f"the answer came in {len(pieces)} chunks, not token by token"

    assert [m.id for m in c.models.list().data] == [args.model]
    for call, error in [
        (lambda: c.chat.completions.create(model="nope", messages=messages), openai.NotFoundError),
        (lambda: c.chat.completions.create(model=args.model, messages=[]), openai.BadRequestError),
        (lambda: openai.OpenAI(base_url=args.base_url, api_key="wrong", max_retries=0).models.list(), openai.AuthenticationError),
    ]:
        try:
            call()
            raise AssertionError(f"no {error.__name__}")
        except error as e:
            assert e.body and e.body.get("message"), e
    print(f"equal: {want['text']!r} ({want['finish_reason']}), streamed in {len(pieces)} chunks")


def rss_kib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def load(args):
    c = client(args)

    def one(i):
        try:
            r = c.completions.create(model=args.model, prompt=f"Request {i}: the", max_tokens=8, temperature=0.7, seed=i)
            assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1, r
            return 200
        except openai.RateLimitError as e:
            assert e.body["code"] == "rate_limit_exceeded", e.body
            return 429

    # Warm-up: the allocator and the engine's buffers reach their working size.
    with ThreadPoolExecutor(args.clients) as pool:
        list(pool.map(one, range(40)))
    before = rss_kib(args.pid)
    start = time.monotonic()
    with ThreadPoolExecutor(args.clients) as pool:
        statuses = list(pool.map(one, range(args.requests)))
    seconds = time.monotonic() - start
    after = rss_kib(args.pid)
    counts = {s: statuses.count(s) for s in set(statuses)}
    assert len(statuses) == args.requests and set(counts) <= {200, 429}, counts
    assert counts.get(200, 0) >= args.clients, f"too few answered: {counts}"
    assert after - before < args.rss_slack_kib, f"RSS grew from {before} to {after} KiB"
    # Still serving after the burst.
    assert one(-1) == 200
    print(f"load: {args.requests} requests in {seconds:.1f} s from {args.clients} clients: {counts.get(200, 0)} answered, "
          f"{counts.get(429, 0)} 429; RSS {before} -> {after} KiB")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["equal", "load"])
    p.add_argument("--base-url", required=True)
    p.add_argument("--api-key", default="none")
    p.add_argument("--model", required=True)
    p.add_argument("--prompt")
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--expect")
    p.add_argument("--pid", type=int)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--rss-slack-kib", type=int, default=4096)
    args = p.parse_args()
    {"equal": equal, "load": load}[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
