"""Secret scrubbing for everything the store persists (run.json, manifests, weights manifests).

Three nets: fields whose *name* marks a secret (key, secret, token, password, credentials, ...),
credentials embedded in URLs (`s3://AK:SK@host`, `https://user:pass@host`), and any literal
secret value the caller knows (the store's own key/secret, AWS_* env values)."""
import contextlib
import os
import re
import uuid

REDACTED = "***"
# Literal values shorter than this are not replaced (a short "secret" such as moto's "testing"
# would mangle ordinary text); real AWS keys are 20 and 40 characters.
MIN_SECRET_LEN = 8

# Word-level rules on the snake_cased field name. Config sizes such as `max_tokens` or
# `ppo_max_token_len_per_gpu`, and verl's `prompt_key` / `reward_fn_key`, are not secrets.
_ALWAYS = {"secret", "secrets", "password", "passwd", "pwd", "credential", "credentials",
           "apikey", "passphrase", "authorization"}
_KEY_PREFIXES = {"access", "api", "private", "secret", "auth", "encryption", "signing", "ssh",
                 "account", "master", "client", "session", "sas"}
_TOKEN_NOT_SECRET = {"pad", "eos", "bos", "unk", "sep", "cls", "mask", "max", "min", "num",
                     "per", "image", "video", "audio", "special", "start", "end", "stop"}
# user:password@ (a password may hold '/', as AWS secrets do) or user@ right after the scheme.
_URL_CREDS = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)(?:[^\s@\"']*:[^\s@\"']*|[^\s/@:\"']+)@")
_ENV_SECRETS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY")


def _words(name: str) -> list:
    snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", str(name))
    return [w for w in re.split(r"[^a-z0-9]+", snake.lower()) if w]


def is_secret_name(name) -> bool:
    """True when a field named `name` holds a credential."""
    words = _words(name)
    if not words:
        return False
    if any(w in _ALWAYS for w in words):
        return True
    last = words[-1]
    prev = words[-2] if len(words) > 1 else None
    if last in ("key", "keyid") or (last == "id" and prev == "key"):
        if words in (["key"], ["key", "id"]):
            return True
        idx = len(words) - (2 if last == "id" else 1)
        before = words[idx - 1] if idx >= 1 else None
        return before in _KEY_PREFIXES or (last == "keyid")
    if last == "token":
        return prev not in _TOKEN_NOT_SECRET
    return False


def scrub_text(text: str, secret_values=()) -> str:
    """Remove URL credentials and literal secret values from a string."""
    text = _URL_CREDS.sub(lambda m: m.group(1) + REDACTED + "@", text)
    for value in secret_values:
        if value and len(value) >= MIN_SECRET_LEN:
            text = text.replace(value, REDACTED)
    return text


def scrub_override(item: str, secret_values=()) -> str:
    """A `key=value` override as it may be stored or shown: the value of a key whose name marks a
    secret (storage.key, storage.secret, ...) becomes '***'; URL credentials and known secret
    values are removed from the rest."""
    key, sep, value = str(item).partition("=")
    if sep and value and is_secret_name(key.lstrip("+~").rsplit(".", 1)[-1]):
        return f"{key}={REDACTED}"
    return scrub_text(str(item), list(secret_values) + env_secret_values())


def split_secret_overrides(overrides) -> tuple[list, list]:
    """(public, secret) overrides: a secret one (a credential key, or a URL with credentials) is
    handed to the training flow as a token (held_secret_overrides), never as its value in a flow
    parameter, which Prefect stores in its database."""
    public, secret = [], []
    for item in overrides or []:
        (secret if scrub_override(item) != item else public).append(item)
    return public, secret


_HELD: dict[str, list] = {}  # token -> secret overrides, in this process only


@contextlib.contextmanager
def held_secret_overrides(secret: list):
    """A random token standing for the `secret` overrides while the block runs, or None when there
    are none. The token is what the training flow gets as a parameter (Prefect records it, and it
    names nothing outside this process); the flow takes the values with take_secret_overrides."""
    if not secret:
        yield None
        return
    token = f"held-in-process:{uuid.uuid4().hex}"
    _HELD[token] = list(secret)
    try:
        yield token
    finally:
        _HELD.pop(token, None)


def take_secret_overrides(token: str | None) -> list | None:
    """The overrides `token` stands for ([] without a token); None for a token this process does
    not hold (a flow run retried elsewhere: credentials then come from that process's environment)."""
    if not token:
        return []
    held = _HELD.get(token)
    return None if held is None else list(held)


def is_scrubbed_override(item: str) -> bool:
    """True for an override whose secret was removed (it cannot be replayed)."""
    key, _, value = str(item).partition("=")
    return value == REDACTED or f"://{REDACTED}@" in value


def env_secret_values() -> list:
    """Secret values present in this process's environment (scrubbed wherever they appear)."""
    return [os.environ[n] for n in _ENV_SECRETS if os.environ.get(n)]


def scrub(obj, secret_values=()):
    """A copy of `obj` (dicts, lists, scalars) with secrets replaced by '***'."""
    values = [v for v in list(secret_values) + env_secret_values() if v]
    values.sort(key=len, reverse=True)
    return _scrub(obj, values)


def _scrub(obj, values):
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            key = scrub_text(str(k), values) if isinstance(k, str) else k
            if is_secret_name(k) and v not in (None, "", [], {}):
                out[key] = REDACTED if not isinstance(v, dict) else _scrub_all(v)
            else:
                out[key] = _scrub(v, values)
        return out
    if isinstance(obj, (list, tuple)):
        if all(type(v) in _NUMBERS for v in obj):  # a row permutation, sizes: nothing to scrub
            return list(obj)
        return [_scrub(v, values) for v in obj]
    if isinstance(obj, str):
        return scrub_text(obj, values)
    return obj


_NUMBERS = (int, float, bool, type(None))


def _scrub_all(d: dict) -> dict:
    """Every leaf of a secret-named mapping (e.g. `credentials: {...}`) is redacted."""
    return {k: (_scrub_all(v) if isinstance(v, dict) else REDACTED) for k, v in d.items()}
