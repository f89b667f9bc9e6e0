"""The generated protobuf/gRPC modules match proto/ (regenerated and compared)."""

from rankwatch.proto import generate, pb


def test_generated_code_is_fresh():
    assert generate.main(["--check"]) == 0, "run: python -m rankwatch.proto.generate"


def test_stale_file_is_detected(tmp_path, monkeypatch):
    # Point the checker at a copy whose generated module is edited: it must fail.
    import shutil

    shutil.copytree(generate.PROTO_ROOT / "rankwatch", tmp_path / "rankwatch")
    target = tmp_path / "rankwatch" / "v1" / "agent_pb2.py"
    target.write_text(target.read_text() + "\n# edited\n")
    monkeypatch.setattr(generate, "PROTO_ROOT", tmp_path)
    assert generate.main(["--check"]) == 1


def test_round_trip():
    b = pb.Batch(seq=3, dropped_total=7)
    b.steps.step.append(5)
    assert pb.Batch.FromString(b.SerializeToString()) == b
