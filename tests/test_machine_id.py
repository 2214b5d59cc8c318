"""``--machine_id auto``: from a Kubernetes Indexed Job's index, else the VM's metadata."""

import urllib.error
import urllib.request

import pytest

from common.cli import UserError
from host.machine_id import metadata_url, resolve_machine_id
from fixtures.gcs_emulator import free_port


def test_an_explicit_number_is_used_as_it_is():
    assert resolve_machine_id(5, environ={"JOB_COMPLETION_INDEX": "2"}) == 5


def test_the_indexed_job_index_comes_first(metadata_server):
    assert resolve_machine_id("auto", environ={"JOB_COMPLETION_INDEX": "2",
                                               "GCE_METADATA_HOST": metadata_server.host}) == 2
    assert metadata_server.requests == []


def test_the_metadata_attribute_with_the_flavor_header(metadata_server):
    assert resolve_machine_id("auto", environ={"GCE_METADATA_HOST": metadata_server.host}) == 3
    assert metadata_server.requests == [("/computeMetadata/v1/instance/attributes/machine-id", "Google")]
    # The server really refuses requests without the header (what the runner must send).
    with pytest.raises(urllib.error.HTTPError, match="403"):
        urllib.request.urlopen(metadata_url({"GCE_METADATA_HOST": metadata_server.host}), timeout=5)


def test_a_vm_without_the_attribute(metadata_server):
    metadata_server.attributes.clear()
    with pytest.raises(UserError, match="no attribute machine-id"):
        resolve_machine_id("auto", environ={"GCE_METADATA_HOST": metadata_server.host})


def test_neither_source_names_both():
    closed = f"127.0.0.1:{free_port()}"
    with pytest.raises(UserError) as e:
        resolve_machine_id("auto", environ={"GCE_METADATA_HOST": closed}, timeout_s=1.0)
    message = str(e.value)
    assert "\n" not in message
    assert "JOB_COMPLETION_INDEX is not set" in message
    url = f"http://{closed}/computeMetadata/v1/instance/attributes/machine-id"
    assert f"metadata server {url}: not reachable" in message


@pytest.mark.parametrize("value", ["-1", "two", ""])
def test_an_index_that_is_not_a_machine_number(value):
    with pytest.raises(UserError, match="is not a machine number"):
        resolve_machine_id("auto", environ={"JOB_COMPLETION_INDEX": value})


def test_a_server_that_never_answers_is_given_up_on():
    import socket
    import time
    with socket.socket() as silent:  # accepts connections (the backlog), never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        start = time.monotonic()
        with pytest.raises(UserError, match="not reachable|no answer within"):
            resolve_machine_id("auto", environ={"GCE_METADATA_HOST": f"127.0.0.1:{silent.getsockname()[1]}"},
                               timeout_s=0.5)
        assert time.monotonic() - start < 10  # the 0.5 s timeout holds (no answer would never come)
