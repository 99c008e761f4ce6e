"""Pieces shared by the `pdcluster` command modules: the help formatter, subcommand
registration, `--model` resolution (a folder, or a GGUF file converted once), and turning
user mistakes into one-line usage errors (exit status 2)."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda")

Handler = Callable[[argparse.Namespace], int]


class UsageError(Exception):
    """A user mistake found after parsing: reported as one line on stderr, exit status 2."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except the uninformative None and False."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def formatter(prog: str) -> argparse.HelpFormatter:
    return HelpFormatter(prog, max_help_position=32)


def add_command(
    subparsers: argparse._SubParsersAction, name: str, help_text: str, handler: Handler
) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        name, help=help_text, description=help_text, formatter_class=formatter
    )
    parser.set_defaults(handler=handler)
    return parser


def require_device(device: str) -> None:
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda given but no CUDA device is available")


def resolve_model_arg(model: str) -> str:
    """`--model` as the folder to serve, absolute (Ray workers need not share our working
    directory): a folder is checked, a GGUF file is converted into the cache once
    (engine.models.gguf) and its folder returned; a bad file is a usage error."""
    if not Path(model).is_file():
        if Path(model).suffix.lower() == ".gguf":
            raise UsageError(f"GGUF file not found: {model}")
        check_model_dir(model)
        return os.path.abspath(model)
    from pdcluster.engine.models.gguf import GGUFError, is_gguf, resolve_model

    if not is_gguf(model):
        raise UsageError(f"not a model folder or a GGUF file: {model}")
    try:
        return resolve_model(model)
    except GGUFError as exc:
        raise UsageError(str(exc)) from exc


def check_model_dir(model: str) -> None:
    path = Path(model)
    if not path.is_dir():
        raise UsageError(f"model folder not found: {model}")
    if not (path / "config.json").is_file():
        raise UsageError(f"not an HF-format model folder (no config.json): {model}")


@contextmanager
def config_errors_as_usage() -> Iterator[None]:
    """Configs validate user values with ValueError at construction: report those as usage."""
    try:
        yield
    except ValueError as exc:
        logger.debug("invalid configuration", exc_info=True)
        raise UsageError(str(exc)) from exc


def cluster_secret_from_env(command: str):
    """The cluster secret from $PDCLUSTER_CLUSTER_SECRET[_FILE]; a usage error without it."""
    from pdcluster.core.credentials import (
        SECRET_ENV,
        SECRET_FILE_ENV,
        ClusterSecret,
        CredentialError,
    )

    try:
        secret = ClusterSecret.from_env()
    except CredentialError as exc:
        raise UsageError(str(exc)) from exc
    if secret is None:
        raise UsageError(f"{command} needs the cluster secret: set ${SECRET_FILE_ENV} to a file "
                         f"holding it (e.g. the one `pdcluster serve` printed) or "
                         f"${SECRET_ENV} to its hex text")
    return secret



def router_token_from_env(command: str) -> str:
    """The router's client credential from $PDCLUSTER_ROUTER_TOKEN[_FILE]; a usage error
    without it."""
    from pdcluster.core.credentials import ROUTER_TOKEN_ENV, ROUTER_TOKEN_FILE_ENV

    token = optional_router_token()
    if token is None:
        raise UsageError(f"{command} needs the router's client credential: set "
                         f"${ROUTER_TOKEN_FILE_ENV} to a file holding it or ${ROUTER_TOKEN_ENV} "
                         "to it (`pdcluster metadata router-token` prints one)")
    return token


def optional_router_token() -> str | None:
    from pdcluster.core.credentials import (
        ROUTER_TOKEN_ENV,
        ROUTER_TOKEN_FILE_ENV,
        CredentialError,
        token_from_env,
    )

    try:
        return token_from_env(ROUTER_TOKEN_ENV, ROUTER_TOKEN_FILE_ENV)
    except CredentialError as exc:
        raise UsageError(str(exc)) from exc


def cache_salt_key_from_env(command: str, required: bool) -> bytes | None:
    """The router's cache-salt key from $PDCLUSTER_CACHE_SALT_KEY[_FILE] (router.tenants); a
    usage error when `required` (API keys set: tenants' caches are salted) and it is unset."""
    from pdcluster.core.credentials import CredentialError, token_from_env
    from pdcluster.router.tenants import SALT_KEY_ENV, SALT_KEY_FILE_ENV

    try:
        key = token_from_env(SALT_KEY_ENV, SALT_KEY_FILE_ENV)
    except CredentialError as exc:
        raise UsageError(str(exc)) from exc
    if key is None and required:
        raise UsageError(f"{command} with API keys needs the cache-salt key every router of "
                         f"the cluster shares: set ${SALT_KEY_FILE_ENV} to a file holding it "
                         f"or ${SALT_KEY_ENV} to it (at least 16 random bytes, e.g. "
                         "`openssl rand -hex 32`; the Helm chart generates one)")
    return None if key is None else key.encode()
