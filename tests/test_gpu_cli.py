"""``rankwatch agent`` GPU flags: bad input is refused with a clear message before anything starts."""

from __future__ import annotations

import json

import pytest

from conftest import has_gpu
from rankwatch.agent.cli.app import main
from rankwatch.agent.gpu.settings import GpuConfig, open_source
from rankwatch.agent.gpu.nvml import NvmlSource, NvmlUnavailable


def agent(tmp_path, *flags: str) -> int:
    argv = ["agent", "--listen", str(tmp_path / "a.sock"), "--metrics-port", "0",
            "--metrics-addr", "127.0.0.1", "--state-dir", str(tmp_path / "state"), *flags]
    try:
        return main(argv)
    except SystemExit as exc:  # argparse refuses the flag
        return int(exc.code)


@pytest.mark.parametrize("flags,message", [
    (("--gpu-source", "nvidia"), "expected auto, nvml, none or script:PATH"),
    (("--gpu-source", "script:{tmp}/missing.json"), "missing.json"),
    (("--gpu-source", "script:{tmp}/bad.json"), "events[0]: 'gpu'"),
    (("--gpu-source", "none", "--dcgm-url", "http://127.0.0.1:9400/metrics"), "exclude each other"),
    (("--dcgm-url", "localhost:9400"), "expected http://HOST:PORT/metrics"),
    (("--gpu-interval", "0"), "must be positive"),
])
def test_bad_gpu_flags_are_refused(tmp_path, capsys, flags, message):
    (tmp_path / "bad.json").write_text(json.dumps({"gpus": {"count": 1}, "events": [{"at": 1, "gpu": 3, "xid": 79}]}))
    assert agent(tmp_path, *(f.format(tmp=tmp_path) for f in flags)) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "a.sock").exists()


@pytest.mark.skipif(has_gpu(), reason="NVML works on this machine; the GPU case is the next test")
def test_nvml_asked_for_fails_loudly_where_there_is_none(tmp_path, capsys):
    with pytest.raises(NvmlUnavailable):
        NvmlSource()
    assert agent(tmp_path, "--gpu-source", "nvml") == 1
    assert "NVML" in capsys.readouterr().err
    assert not (tmp_path / "a.sock").exists()  # the agent let go of what it had started


@pytest.mark.gpu
def test_nvml_asked_for_on_a_gpu_gives_readings():
    source = open_source(GpuConfig(source="nvml"))
    try:
        assert isinstance(source, NvmlSource) and source.read() and all(r.up for r in source.read())
    finally:
        source.close()
