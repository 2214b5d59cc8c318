"""``--machine_id auto``: a host learns its machine number from where a fleet puts it.

Sources, in order:
  1. ``JOB_COMPLETION_INDEX``, set in every pod of a Kubernetes Indexed Job;
  2. the instance metadata attribute ``machine-id`` of the GCE / Cloud TPU VM metadata server
     (set when the VM or queued resource is created), at ``GCE_METADATA_HOST`` if set (as
     Google's client libraries honour it), else ``metadata.google.internal``.
Neither: one line that says what was tried.
"""

from __future__ import annotations

import logging
import os
import threading
import urllib.error
import urllib.request
from typing import Mapping

from common.cli import AUTO, UserError, int_or_auto

log = logging.getLogger("runners.tpu_host")
INDEX_ENV = "JOB_COMPLETION_INDEX"
METADATA_HOST_ENV = "GCE_METADATA_HOST"
DEFAULT_METADATA_HOST = "metadata.google.internal"
ATTRIBUTES_PATH = "/computeMetadata/v1/instance/attributes/"
TIMEOUT_S = 2.0  # off GCE the server does not exist: give up fast


machine_id_flag = int_or_auto("a machine number")  # ``--machine_id``: a number, or auto


def resolve_machine_id(value: int | str, environ: Mapping[str, str] = os.environ,
                       timeout_s: float = TIMEOUT_S) -> int:
    """``value`` itself if it is a number; for ``auto``, the first source that has one."""
    if value != AUTO:
        return int(value)
    tried = []
    index = environ.get(INDEX_ENV)
    if index is not None:
        return _as_id(index, f"{INDEX_ENV}={index!r}")
    tried.append(f"{INDEX_ENV} is not set")
    url = metadata_url(environ)
    answer, problem = metadata_attribute(url, timeout_s)
    if answer is not None:
        return _as_id(answer, f"metadata attribute machine-id {answer!r} ({url})")
    tried.append(f"metadata server {url}: {problem}")
    raise UserError("--machine_id auto found no machine id: " + "; ".join(tried)
                    + " (pass --machine_id N, run as a Kubernetes Indexed Job, or set the VM's "
                    "metadata attribute machine-id)")


def metadata_url(environ: Mapping[str, str] = os.environ, attribute: str = "machine-id") -> str:
    host = environ.get(METADATA_HOST_ENV) or DEFAULT_METADATA_HOST
    return f"http://{host}{ATTRIBUTES_PATH}{attribute}"


def _as_id(text: str, source: str) -> int:
    try:
        machine_id = int(text.strip())
    except ValueError:
        machine_id = -1
    if machine_id < 0:
        raise UserError(f"--machine_id auto: {source} is not a machine number (an integer >= 0)")
    log.info("machine id %d from %s", machine_id, source)
    return machine_id


def metadata_attribute(url: str, timeout_s: float) -> tuple[str | None, str]:
    """(the attribute's text, "") or (None, why not). The whole request, name resolution
    included (which a socket timeout does not bound), gets ``timeout_s``."""
    result: list[tuple[str | None, str]] = []

    def fetch() -> None:
        request = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                if response.headers.get("Metadata-Flavor") != "Google":
                    result.append((None, "the answer lacks the header Metadata-Flavor: Google"))
                else:
                    result.append((response.read().decode("utf-8", "replace"), ""))
        except urllib.error.HTTPError as e:
            attribute = url.rsplit("/", 1)[-1]
            result.append((None, f"no attribute {attribute}" if e.code == 404 else f"HTTP {e.code}"))
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            result.append((None, f"not reachable ({reason})"))

    thread = threading.Thread(target=fetch, daemon=True, name="machine-id-lookup")
    thread.start()
    thread.join(timeout_s + 0.5)
    return result[0] if result else (None, f"no answer within {timeout_s:.0f} s")
