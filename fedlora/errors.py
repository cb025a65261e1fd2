"""Errors users see. One class, so the CLI can print them as one line without a traceback."""


class ConfigError(ValueError):
    """A bad option or input: the message names the field and what is allowed."""


def did_you_mean(key: str, allowed, cutoff: float = 0.6) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``allowed`` to a misspelt ``key`` (difflib), else ``""``.
    The one suggestion helper of every configuration reader (llm's config, synthetic's commands)."""
    import difflib

    close = difflib.get_close_matches(str(key), [str(a) for a in allowed], n=1, cutoff=cutoff)
    return f" (did you mean {close[0]!r}?)" if close else ""


def quoted(names) -> str:
    """Names as a message lists them: ``'a', 'b'`` (not a Python list's ``['a', 'b']``)."""
    return ", ".join(repr(n) for n in names)


def plural(n: int, word: str, words: str | None = None) -> str:
    """``n`` and the noun in its number: ``plural(1, "round")`` → "1 round", ``plural(3, "class", "classes")``
    → "3 classes" (``words`` for a plural that is not ``word + "s"``)."""
    return f"{n} {word if n == 1 else (words or word + 's')}"


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM, raised in the main thread by the ``fedlora`` command's handlers: a
    ``KeyboardInterrupt``, so whatever cleans up after Ctrl-C (a run marking its folder incomplete)
    cleans up after SIGTERM too. ``signum`` / ``signal_name``: which signal; the command exits with
    128 + signum (130, 143)."""

    def __init__(self, signum: int) -> None:
        import signal

        self.signum = int(signum)
        self.signal_name = signal.Signals(self.signum).name
        super().__init__(self.signal_name)


class RoundFailed(RuntimeError):
    """A round without enough accepted uploads (fewer than ``federation.min_clients``): the run stops,
    its last checkpoint kept (``fedlora.server``). The command prints it as one line."""
