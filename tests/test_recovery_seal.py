"""The recovery store's values are sealed with the job's token: a writer without it (anyone who
can reach the TCPStore) cannot make the workers take its decision, its join request or its
"restarting" mark.  A real TCPStore on loopback; the workers' protocol is the real
:class:`~rankwatch.hooks.recovery.protocol.Round`."""

from __future__ import annotations

import json
import threading

import pytest
from torch.distributed import TCPStore

from rankwatch.hooks.recovery.decide import JOINER_BASE, Decision, Membership
from rankwatch.hooks.recovery.protocol import RecoveryFailed, Round
from rankwatch.hooks.recovery.store import RESTARTING_KEY, ForgedValue, Seal

PREFIX = "rankwatch/job/round/1/"
ENV = {"RANKWATCH_TOKEN": "s3cret", "RANKWATCH_NODE_ID": "n0"}


def test_a_sealed_value_opens_only_under_its_key_with_the_token():
    seal = Seal("s3cret")
    sealed = seal.seal("a/decision", '{"ok": true}')
    assert sealed != b'{"ok": true}' and seal.open("a/decision", sealed) == b'{"ok": true}'
    for key, raw, by in [("b/decision", sealed, seal),                      # moved to another key
                         ("a/decision", b'{"ok": true}', seal),             # written bare
                         ("a/decision", Seal("guess").seal("a/decision", '{"ok": true}'), seal),  # another token
                         ("a/decision", sealed.replace(b"true", b"false"), seal),  # changed after sealing
                         ("a/decision", sealed, Seal("other"))]:
        with pytest.raises(ForgedValue):
            by.open(key, raw)
    plain = Seal(None)   # no token: the store's own access control is all
    assert plain.seal("k", "v") == b"v" and plain.open("k", b"v") == b"v"


def test_the_token_comes_from_the_job_s_token_file(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(0o600)
    sealed = Seal.from_env({"RANKWATCH_TOKEN_FILE": str(token)}).seal("k", "v")
    assert Seal("s3cret").open("k", sealed) == b"v"
    token.chmod(0o644)
    with pytest.raises(ValueError, match="readable by group or others"):
        Seal.from_env({"RANKWATCH_TOKEN_FILE": str(token)})


@pytest.fixture
def store():
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield TCPStore("127.0.0.1", master.port, is_master=False, wait_for_workers=False)
    del master


def test_a_forged_decision_is_not_taken(store):
    """The forger arrives first and writes the decision; a survivor refuses it."""
    survivor = Round(store, PREFIX, ENV, settle=0.5)
    old = Membership(generation=0, rank=1, world_size=2, members=(0, 1))
    forged = Decision(ok=True, members=(1,), step=5).to_json()
    store.add(survivor.key("gen/1/arrived"), 1)
    store.set(survivor.key("gen/1/decision"), forged)
    decision = survivor.agree(old, completed=5, replica_size=1, ready=False, settled=set())
    assert not decision.ok and "not sealed with the job's token" in decision.error
    # The same decision sealed by a worker of the job is taken.
    store.set(survivor.key("gen/1/decision"), survivor.seal.seal(survivor.key("gen/1/decision"), forged))
    decision = survivor.agree(old, completed=5, replica_size=1, ready=False, settled=set())
    assert decision.ok and decision.members == (1,) and decision.step == 5


def test_a_forged_join_request_is_ignored_and_a_sealed_one_is_seen(store):
    rank0 = Round(store, PREFIX, ENV, settle=0.5)
    n = int(store.add(rank0.key("join/seq"), 1))
    store.set(rank0.key(f"join/{n}"), json.dumps({"node": "evil", "local_rank": 0, "local_world": 1}))
    settled: set[int] = set()
    assert rank0.waiting_joiners(store, settled) == [] and settled == {JOINER_BASE + n}
    joiner = Round(store, PREFIX, {**ENV, "RANKWATCH_NODE_ID": "spare"}, settle=0.5)
    me = joiner.ask_to_join("127.0.0.1:1", local_rank=0, local_world=1)
    assert [(j.id, j.node) for j in rank0.waiting_joiners(store, settled)] == [(me, "spare")]


def test_a_forged_answer_to_a_joiner_fails_its_join(store):
    joiner = Round(store, PREFIX, {**ENV, "RANKWATCH_NODE_ID": "spare"}, settle=0.5)
    me = joiner.ask_to_join("127.0.0.1:1", local_rank=0, local_world=1)
    store.set(joiner.key(f"joined/{me}"), "1")   # "admitted at generation 1", unsealed
    with pytest.raises(RecoveryFailed, match="not sealed with the job's token"):
        joiner.await_admission(me, timeout=5)


def test_a_forged_restarting_mark_fails_the_decision_and_changes_no_membership(store):
    """The first survivor to arrive decides; a bare "restarting" mark in the store does not
    read as torchrun's (which would be a failed decision naming that node): the decision
    fails as forged instead, and names no node."""
    first = Round(store, PREFIX, ENV, settle=0.5)
    other = Round(store, PREFIX, {**ENV, "RANKWATCH_NODE_ID": "n1"}, settle=0.5)
    for rank, who in enumerate((first, other)):
        who.register(rank, 2, "127.0.0.1:1")
    store.set(PREFIX + RESTARTING_KEY, "evil")
    result: dict = {}
    late = threading.Thread(target=lambda: result.update(d=other.agree(
        Membership(generation=0, rank=1, world_size=2, members=(0, 1)), 3, 1, False, set())))
    decision = first.agree(Membership(generation=0, rank=0, world_size=2, members=(0, 1)), 3, 1, False, set())
    late.start()
    late.join(10)
    assert not decision.ok and "not sealed" in decision.error and "evil" not in decision.error
    assert not result["d"].ok and result["d"].error == decision.error


def test_an_unreadable_token_gives_a_seal_that_opens_nothing():
    """A node whose token file cannot be read must not fall back to the open, tokenless seal
    (which takes any value as it is): its seal opens neither the job's values nor bare ones,
    and what it seals opens nowhere else."""
    job, unusable = Seal("s3cret"), Seal.unusable()
    assert unusable.on
    for raw in (job.seal("k", "v"), b"v", Seal.unusable().seal("k", "v")):
        with pytest.raises(ForgedValue):
            unusable.open("k", raw)
    with pytest.raises(ForgedValue):
        job.open("k", unusable.seal("k", "v"))


def test_the_handler_treats_a_forged_mark_as_absent_and_warns_once(store, caplog):
    """The rendezvous handler's reader of its round's marks, asked again at every poll as
    torchrun's agent asks, against a mark a writer without the token left."""
    from rankwatch.hooks.rendezvous.round_keys import InProcessRound
    from rankwatch.hooks.recovery.store import mark_regrouped

    mine = InProcessRound(store, "job", "n0", Seal("s3cret"), current_round=lambda: 1)
    mine.export(1, None, 2)
    prefix = mine.prefix
    assert prefix == PREFIX
    mark_regrouped(store, prefix, "n1", 1, Seal(None))   # the forger "left n1 out"
    with caplog.at_level("DEBUG", logger="rankwatch.hooks.rendezvous.round_keys"):
        assert not any(mine.regrouped("n1") for _ in range(5))
    warned = [r for r in caplog.records if r.levelname == "WARNING" and "not sealed" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    mark_regrouped(store, prefix, "n2", 1, Seal("s3cret"))   # the workers left n2 out
    assert mine.regrouped("n2")
