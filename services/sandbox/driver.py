"""Runs inside the sandbox (system Python, stdlib only): calls the submitted module's functions.

Reads every call from stdin (function name and arguments only: the expected answers never enter
the sandbox), answers one JSON line per call on the reply channel (the original stdout; the
program's own prints go to stderr), and writes ``done`` last.  It computes no verdict: the
checker outside compares the answers, so patching this file's code in memory, ``sys.exit`` or
``unittest`` can at most change what is answered, never what counts as right.
"""

import json
import os
import sys

# Bound before the submission runs: patching os.getpid later does not change this reference, so
# answers written by a forked child (fork-and-exit) carry the child's pid and are rejected outside.
getpid = os.getpid
PLAIN = (str, int, float, bool, type(None))


def plain(value, depth=0):
    """Exact built-in types only: a subclass could carry an ``__eq__`` that always says yes."""
    if depth > 50:
        return False
    if type(value) in PLAIN:
        return True
    if type(value) in (list, tuple):
        return all(plain(v, depth + 1) for v in value)
    if type(value) is dict:
        return all(type(k) is str and plain(v, depth + 1) for k, v in value.items())
    return False


def main():
    request = json.loads(sys.stdin.buffer.read())
    channel = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def reply(obj):
        obj["pid"] = getpid()
        channel.write(json.dumps(obj) + "\n")
        channel.flush()

    reply({"hello": True})
    sys.path.insert(0, os.getcwd())
    try:
        module = __import__(request["module"])
    except BaseException as exc:  # the module's failure to load is the verdict, whatever it raised
        reply({"import_error": f"{type(exc).__name__}: {exc}"[:500]})
        return
    for call in request["calls"]:
        try:
            value = getattr(module, call["fn"])(*call["args"], **call["kwargs"])
        except BaseException as exc:  # an expected exception is a test outcome, not a crash
            reply({"id": call["id"], "raised": type(exc).__name__})
            continue
        if plain(value):
            reply({"id": call["id"], "value": value})
        else:
            reply({"id": call["id"], "not_plain": type(value).__name__})
    reply({"done": len(request["calls"])})


main()
