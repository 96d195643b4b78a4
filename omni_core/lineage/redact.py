"""Keep secrets out of MLflow: redact credentials from params, tags, artifacts and dataset inputs.

Three rules, applied to every string that is logged (and to the keys of nested dicts and lists):
1. A value whose key looks secret is replaced whole: the key's last word is password, secret,
   token, credential(s), auth, ... or `key` after api/access/secret/private/session/...
   (`aws_secret_access_key`, `AWS_SESSION_TOKEN`, `hf_token`, `apiKey`), but not `max_new_tokens`,
   `tokenizer`, `run_key`, `cache_key` or `aws_access_key_id`.
2. Credentials inside a string: the password of a URI (`s3://user:REDACTED@host`; a user alone
   is redacted too, being often a token: `https://REDACTED@host`) and the value of a secret-named
   `name=value` (query parameters `?token=...`, `X-Amz-Signature=...`, `PASSWORD=...` in a command).
3. The values of secret-named environment variables (AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN,
   HF_TOKEN, MLFLOW_TRACKING_PASSWORD, ...; 8 characters or more), wherever they appear. They are
   read at each call, so a variable set after import counts too.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

REDACTED = "REDACTED"  # URL- and filename-safe: `s3://user:REDACTED@host` still parses
MIN_SECRET_LENGTH = 8  # shorter env values ("1", "true", a test's "testing") would redact ordinary words

# The last word of a key that names a secret. "pwd" is left out: $PWD is the working directory.
_SECRET_WORDS = frozenset({
    "password", "passwd", "passphrase", "secret", "secrets", "token", "credential", "credentials", "auth",
    "authorization", "bearer", "cookie", "apikey", "signature", "sig", "privatekey", "secretkey", "accesskey",
})
_KEY_QUALIFIERS = frozenset({  # `key` after one of these names a secret (`run_key`, `cache_key` do not)
    "api", "access", "secret", "private", "session", "signing", "encryption", "master", "client", "auth",
    "account", "ssh", "license", "deploy", "shared", "storage", "sas",
})
# Environment variables whose values are secrets although their names do not say so by rule 1.
SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN",
              "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "PREFECT_API_KEY", "WANDB_API_KEY",
              "GITHUB_TOKEN", "AZURE_STORAGE_KEY", "AZURE_STORAGE_CONNECTION_STRING", "OMNI_S3_ENDPOINT_URL",
              "AWS_ENDPOINT_URL")

_WORD_SPLIT = re.compile(r"[^A-Za-z0-9]+|(?<=[a-z0-9])(?=[A-Z])")
_URI_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^/@\s:?#]*)(?::(?P<password>[^/@\s?#]*))?@")
_NAME_VALUE = re.compile(r"(?P<name>(?<![A-Za-z0-9_.])[A-Za-z_][A-Za-z0-9_.-]*)(?P<sep>=)(?P<value>[^&#\s;,'\"]+)")


def is_secret_key(key: Any) -> bool:
    """Whether a param, tag, dict or env name says its value is a secret (rule 1)."""
    words = [w.lower() for w in _WORD_SPLIT.split(str(key)) if w]
    if not words:
        return False
    last = words[-1]
    if last in _SECRET_WORDS:
        return True
    return last == "key" and len(words) > 1 and words[-2] in _KEY_QUALIFIERS


def env_secrets(environ: Mapping[str, str] | None = None) -> list[str]:
    """Values of secret environment variables, longest first (so a secret containing another goes whole).

    Endpoint URLs are not secret themselves: only their embedded credentials are (handled by rule 2),
    so for those the userinfo part is what is taken."""
    environ = os.environ if environ is None else environ
    found = set()
    for name, value in environ.items():
        if not value or not (name in SECRET_ENV or is_secret_key(name)):
            continue
        if "://" in value:  # an endpoint: only its user:password is secret
            for match in _URI_USERINFO.finditer(value):
                found.update(v for v in (match["password"], match["user"]) if v)
            continue
        if os.path.isabs(value) and os.path.exists(value):  # a file's path (GOOGLE_APPLICATION_CREDENTIALS, SSH_AUTH_SOCK)
            continue
        found.add(value)
    return sorted((v for v in found if len(v) >= MIN_SECRET_LENGTH), key=len, reverse=True)


def redact_text(text: str, secrets: list[str] | None = None) -> str:
    """`text` with URI credentials, secret-named `name=value` values and env secrets replaced (rules 2, 3)."""
    secrets = env_secrets() if secrets is None else secrets
    for secret in secrets:
        if secret in text:
            text = text.replace(secret, REDACTED)

    def userinfo(match: re.Match[str]) -> str:
        if match["password"] is not None:
            return f"{match['scheme']}{match['user']}:{REDACTED}@"
        return f"{match['scheme']}{REDACTED}@" if match["user"] else match[0]

    text = _URI_USERINFO.sub(userinfo, text)
    return _NAME_VALUE.sub(
        lambda m: f"{m['name']}{m['sep']}{REDACTED}" if is_secret_key(m["name"]) else m[0], text)


def redact(value: Any, key: Any = None, *, secrets: list[str] | None = None) -> Any:
    """A copy of `value` (a scalar, or nested dicts/lists/tuples) with every secret redacted.

    Under a secret-looking `key` every string (and every string inside a container) becomes
    REDACTED; elsewhere strings go through `redact_text`. Dict keys are redacted as text too.
    Numbers, booleans and None are kept."""
    secrets = env_secrets() if secrets is None else secrets
    whole = key is not None and is_secret_key(key)
    return _redact(value, whole, secrets)


def _redact(value: Any, whole: bool, secrets: list[str]) -> Any:
    if isinstance(value, Mapping):
        return {(redact_text(k, secrets) if isinstance(k, str) else k):
                _redact(v, whole or is_secret_key(k), secrets) for k, v in value.items()}
    if isinstance(value, list | tuple):
        items = [_redact(v, whole, secrets) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, bytes):
        return REDACTED if whole else value
    if isinstance(value, str):
        if whole and value:
            return REDACTED
        return redact_text(value, secrets)
    if value is None or isinstance(value, bool | int | float):
        return value
    text = str(value)  # another object: MLflow would log its str()
    redacted = REDACTED if whole else redact_text(text, secrets)
    return value if redacted == text else redacted


def redact_mapping(items: Mapping[str, Any]) -> dict[str, Any]:
    """Params or tags: each value redacted by its key and its text; the keys redacted as text."""
    secrets = env_secrets()
    return {redact_text(str(k), secrets): redact(v, k, secrets=secrets) for k, v in items.items()}
