import pytest

from rankwatch.address import Address, default_address, resolve


@pytest.mark.parametrize("text,path,host,port", [
    ("/run/rw.sock", "/run/rw.sock", None, None),
    ("unix:/run/rw.sock", "/run/rw.sock", None, None),
    ("unix:///run/rw.sock", "/run/rw.sock", None, None),
    ("127.0.0.1:5000", None, "127.0.0.1", 5000),
    ("[::1]:5000", None, "::1", 5000),
    ("agent.sock", "agent.sock", None, None),
])
def test_parse(text, path, host, port):
    a = Address.parse(text)
    assert (a.path, a.host, a.port) == (path, host, port)


@pytest.mark.parametrize("bad", ["", "unix:", "host:notaport", "host:70000", "justaname"])
def test_parse_rejects(bad):
    with pytest.raises(ValueError):
        Address.parse(bad)


def test_resolve_order(monkeypatch):
    monkeypatch.delenv("RANKWATCH_AGENT", raising=False)
    assert resolve(None) == default_address()
    monkeypatch.setenv("RANKWATCH_AGENT", "10.0.0.1:9")
    assert resolve(None) == Address(host="10.0.0.1", port=9)
    assert resolve("/x.sock") == Address(path="/x.sock")
