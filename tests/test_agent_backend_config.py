"""The production host backend built from the agent config's [libvirt] table."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.backend import HostError
from agent.backends.from_config import BackendConfigError, host_backend_from_config
from agent.backends.libvirt_slice import LibvirtSliceBackend
from agent.contract import HostErrorType
from tests.test_agent_host import baremetal_spec

HOST_XML = Path(__file__).parent / "data" / "libvirt" / "host.xml"


def write_config(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "agent.toml"
    path.write_text('api_url = "https://api.example"\nenrollment_token = "gpe_x"\n' + body)
    return path


def test_host_backend_serves_slices_on_libvirt_and_refuses_bare_metal(tmp_path: Path) -> None:
    config = write_config(
        tmp_path,
        f"""
[libvirt]
uri = "test://{HOST_XML}"
image_dir = "{tmp_path}/images"
seed_dir = "{tmp_path}/seeds"
state_dir = "{tmp_path}/state"
readiness = "ssh"
check_gpu_health = false
uplink = "bond0"
[libvirt.images]
"ubuntu-22.04-cuda" = "ABCDEF"
""",
    )
    backend = host_backend_from_config(config)
    assert isinstance(backend.slice, LibvirtSliceBackend)
    assert backend.slice.images.catalog == {"ubuntu-22.04-cuda": "abcdef"}
    assert backend.slice.gpu_health is None
    assert backend.slice.networks is not None
    assert backend.slice.networks.uplink == "bond0"
    with pytest.raises(HostError) as refused:
        backend.provision_baremetal_user(baremetal_spec("n1"), lambda *a, **k: None)  # type: ignore[arg-type]
    assert refused.value.error_type == HostErrorType.INVALID_SPEC


@pytest.mark.parametrize(
    ("body", "complaint"),
    [
        ("", "a [libvirt] table is needed"),
        ('[libvirt]\nimage_dir = "/x"\nseed_dir = "/y"\n', "needs state_dir"),
        ('[libvirt]\nreadiness = "telepathy"\n', "readiness must be one of"),
        ("[libvirt]\nimages = 3\n", "maps image names"),
    ],
)
def test_bad_backend_config_is_refused_clearly(tmp_path: Path, body: str, complaint: str) -> None:
    with pytest.raises(BackendConfigError) as err:
        host_backend_from_config(write_config(tmp_path, body))
    assert complaint in str(err.value)
