"""The engine's use of the store: pruning a node's part of multi-node checkpoints never drops the last
generation every node has; a restore takes only checkpoints of the job's own uid."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest

from singularity_slurm.checkpoint.criu import RestoreRefused
from singularity_slurm.checkpoint.store import CheckpointStore
from singularity_slurm.node.engine import CheckpointEngine, _check_taken_for

JOB, RUN = 42, "0-0123456789abcdef"


def engine_on(tmp_path: Path, keep: int = 3) -> CheckpointEngine:
    store = CheckpointStore(tmp_path / "store", max_chunk=4096)
    return CheckpointEngine(None, "n1", tmp_path, store, None, None, keep=keep)  # type: ignore[arg-type]


def commit(engine: CheckpointEngine, generation: str | None, data: bytes, run: str = RUN) -> None:
    with engine.store.begin(JOB, reason="periodic", meta={"generation": generation, "run": run}) as writer:
        writer.add_bytes("images/pages-1.img", data)
        writer.commit()


def generations(engine: CheckpointEngine) -> list[str]:
    return [m.meta["generation"] for m in engine.store.list(JOB)]


def test_a_node_keeps_the_generation_the_others_have_though_it_has_newer_ones(tmp_path: Path) -> None:
    # Generations 1.1 and 1.2 reached every node; 1.3 and 1.4 failed on another node.
    engine = engine_on(tmp_path)
    for i, generation in enumerate(["1.1", "1.2", "1.3", "1.4", "1.5"]):
        commit(engine, generation, bytes([i]) * 4096)

    engine._prune(JOB, "1.5", RUN, common=["1.2", "1.1"])

    assert generations(engine) == ["1.1", "1.2", "1.5"]  # keep=3: two common ones and the one just written
    assert engine.store.latest_valid(JOB)[0].meta["generation"] == "1.5"


def test_a_late_prune_never_deletes_a_checkpoint_newer_than_its_own(tmp_path: Path) -> None:
    # Generation 1.2's prune was queued behind the upload lock while 1.3 committed: its choice of what
    # to keep (1.2 and the common 1.1) does not know 1.3, which must stay all the same.
    engine = engine_on(tmp_path, keep=2)
    for i, generation in enumerate(["1.0", "1.1", "1.2", "1.3"]):
        commit(engine, generation, bytes([i]) * 4096)
    seq_of_12 = engine.store.list(JOB)[2].seq

    engine._prune(JOB, "1.2", RUN, common=["1.1"], before=seq_of_12)
    assert generations(engine) == ["1.1", "1.2", "1.3"]

    plain = engine_on(tmp_path / "plain", keep=1)
    for i in range(3):
        commit(plain, None, bytes([i]) * 4096)
    first = plain.store.list(JOB)[0].seq
    plain._prune(JOB, None, RUN, common=None, before=first + 1)  # the prune of the first commit
    assert len(plain.store.list(JOB)) == 2  # only the first went; the two that came later stay


def test_restart_ten_is_kept_over_restart_nine(tmp_path: Path) -> None:
    engine = engine_on(tmp_path, keep=2)
    for i, generation in enumerate(["9.500", "10.100", "10.200"]):
        commit(engine, generation, bytes([i]) * 4096)

    engine._prune(JOB, "10.200", RUN, common=["9.500", "10.100"])

    assert generations(engine) == ["10.100", "10.200"]


def test_keeping_one_checkpoint_still_keeps_the_newest_common_generation(tmp_path: Path) -> None:
    engine = engine_on(tmp_path, keep=1)
    for i, generation in enumerate(["1.1", "1.2", "1.3"]):
        commit(engine, generation, bytes([i]) * 4096)

    engine._prune(JOB, "1.3", RUN, common=["1.2", "1.1"])  # 1.3 may not have reached every node

    assert generations(engine) == ["1.2", "1.3"]


def test_without_knowing_what_every_node_has_nothing_is_pruned(tmp_path: Path) -> None:
    engine = engine_on(tmp_path, keep=1)
    for i, generation in enumerate(["1.1", "1.2", "1.3"]):
        commit(engine, generation, bytes([i]) * 4096)

    engine._prune(JOB, "1.3", RUN, common=None)

    assert generations(engine) == ["1.1", "1.2", "1.3"]


def test_other_runs_checkpoints_are_left_alone(tmp_path: Path) -> None:
    engine = engine_on(tmp_path, keep=1)
    commit(engine, "1.1", b"a" * 4096, run="0-ffffffffffffffff")
    commit(engine, "1.2", b"b" * 4096)
    commit(engine, "1.25", b"c" * 4096)
    commit(engine, "1.3", b"d" * 4096)

    engine._prune(JOB, "1.3", RUN, common=["1.25", "1.2"])

    assert generations(engine) == ["1.1", "1.25", "1.3"]


@pytest.mark.parametrize("keep", [1, 3])
def test_single_node_checkpoints_keep_the_newest(tmp_path: Path, keep: int) -> None:
    engine = engine_on(tmp_path, keep=keep)
    for i in range(4):
        commit(engine, None, bytes([i]) * 4096)

    engine._prune(JOB, None, RUN, common=None)

    assert engine.store.seqs(JOB) == [1, 2, 3, 4][-keep:]


@pytest.mark.parametrize("generation", [None, "1.4"])
def test_retention_reads_each_manifest_once_and_collects_what_only_the_dropped_ones_used(
        tmp_path: Path, generation: str | None) -> None:
    engine = engine_on(tmp_path, keep=2)
    for i in range(4):
        commit(engine, None if generation is None else f"1.{i + 1}", bytes([i]) * 4096)
    reads: list[int] = []
    read = engine.store.read

    def counted(job_id, seq):
        reads.append(seq)
        return read(job_id, seq)

    engine.store.read = counted  # type: ignore[method-assign]
    engine._prune(JOB, generation, RUN, common=None if generation is None else ["1.3"])

    assert sorted(reads) == [1, 2, 3, 4]  # the choice and the collection share one reading
    assert engine.store.seqs(JOB) == [3, 4]
    engine.store.read = read  # type: ignore[method-assign]
    for manifest in engine.store.list(JOB):
        engine.store.restore(manifest, tmp_path / f"restored-{manifest.seq}")
        assert (tmp_path / f"restored-{manifest.seq}/images/pages-1.img").read_bytes() == (
            bytes([manifest.seq - 1]) * 4096)
    assert engine.store.collect_garbage(JOB).chunks_deleted == 0  # the dropped ones' chunks went already


def test_a_checkpoint_of_another_uid_is_refused_as_a_reused_job_id(tmp_path: Path) -> None:
    engine = engine_on(tmp_path)
    with engine.store.begin(JOB, reason="periodic", meta={"uid": 1001}) as writer:
        writer.add_bytes("images/core-1.img", b"core")
        manifest = writer.commit()

    _check_taken_for(manifest, 1001)
    with pytest.raises(RestoreRefused, match="holds the processes of uid 1001, and job 42 runs as uid 1000: "
                                             "the job id was used by an earlier job"):
        _check_taken_for(manifest, 1000)


def rank_engines(tmp_path: Path, ranks: int, keep: int = 3) -> list[CheckpointEngine]:
    from singularity_slurm.config import parse

    config = parse({"paths": {"store_root": str(tmp_path / "store")}})
    base = CheckpointEngine(config, "n1", tmp_path, CheckpointStore(tmp_path / "store"), None,  # type: ignore[arg-type]
                            None, keep=keep)  # type: ignore[arg-type]
    return [base.for_tree(r, rank=True) for r in range(ranks)]


def commit_rank(engine: CheckpointEngine, generation: str, data: bytes) -> int:
    meta = {"generation": generation, "run": RUN, "rank": engine.rank}
    with engine.store.begin(JOB, reason="periodic", meta=meta) as writer:
        writer.add_bytes("images/pages-1.img", data)
        return writer.commit().new_bytes


def test_the_ranks_of_a_distributed_job_share_one_folder_and_store_replicas_once(tmp_path: Path) -> None:
    engines = rank_engines(tmp_path, 3)
    replica = os.urandom(16384)  # 4 pages every rank holds alike (DDP parameters)
    stored = [commit_rank(e, "1.1", replica + bytes([e.rank]) * 4096) for e in engines]

    assert {e.store.job_dir(JOB) for e in engines} == {tmp_path / "store" / "jobs" / str(JOB)}
    assert stored == [20480, 4096, 4096]  # after rank 0, only each rank's own page is new
    assert [e.generations(JOB, RUN) for e in engines] == [["1.1"]] * 3
    assert [e._generation(JOB, "1.1", RUN).meta["rank"] for e in engines] == [0, 1, 2]


def test_a_rank_prunes_only_its_own_checkpoints_in_the_shared_folder(tmp_path: Path) -> None:
    zero, one = rank_engines(tmp_path, 2, keep=1)
    for i, generation in enumerate(["1.1", "1.2", "1.3"]):
        commit_rank(zero, generation, bytes([i]) * 4096)
    commit_rank(one, "1.1", b"x" * 4096)

    zero._prune(JOB, "1.3", RUN, common=["1.2"])

    assert zero.generations(JOB, RUN) == ["1.2", "1.3"]
    assert one.generations(JOB, RUN) == ["1.1"]  # rank 1's checkpoint is rank 1's to drop

    one._prune(JOB, None, RUN, common=None)  # a checkpoint without a generation keeps the newest few
    assert one.generations(JOB, RUN) == ["1.1"] and zero.generations(JOB, RUN) == ["1.2", "1.3"]


def test_retention_runs_after_the_answer_under_the_upload_lock_and_settle_waits_for_it(
        tmp_path: Path) -> None:
    engine = engine_on(tmp_path, keep=1)
    tree = copy.copy(engine)  # as for_tree makes a tree's engine
    for i in range(3):
        commit(engine, None, bytes([i]) * 4096)
    with engine.upload_lock:  # a tree of the node is storing: retention waits for it
        tree._prune_later(JOB, 3, None, None, None)
        assert not engine.settle(0.05)
        assert len(engine.store.list(JOB)) == 3
    assert engine.settle(10)  # the trees share the list the agent waits on
    assert [m.seq for m in engine.store.list(JOB)] == [3]


def test_retention_that_fails_leaves_the_checkpoints_and_is_logged(tmp_path: Path, caplog) -> None:
    engine = engine_on(tmp_path, keep=1)
    for i in range(2):
        commit(engine, None, bytes([i]) * 4096)

    def broken(*args, **kwargs):
        raise RuntimeError("disk on fire")

    engine._prune = broken  # type: ignore[method-assign]
    engine._prune_later(JOB, 2, None, None, None)
    assert engine.settle(10)
    assert len(engine.store.list(JOB)) == 2
    assert "old checkpoints not pruned" in caplog.text


def test_a_restore_reads_each_checkpoint_once_and_falls_back_past_a_corrupt_one(tmp_path: Path,
                                                                               monkeypatch) -> None:
    from singularity_slurm.checkpoint import images

    engine = engine_on(tmp_path)
    for data in (b"a" * 8192, b"b" * 8192):
        with engine.store.begin(JOB, reason="periodic", meta={"uid": os.getuid()}) as writer:
            writer.add_bytes("images/pages-1.img", data)
            writer.commit()
    newest = engine.store.list(JOB)[-1]
    pack, offset, _ = engine.store.locate(JOB, newest.files[0].chunks[0].hash)
    data = bytearray(pack.read_bytes())
    data[offset] ^= 0x01
    pack.write_bytes(bytes(data))
    reads: list[int] = []
    real = engine.store._file_data
    monkeypatch.setattr(engine.store, "_file_data", lambda m, *a: reads.append(m.seq) or real(m, *a))
    monkeypatch.setattr(engine, "_check_trusted", lambda job: None)
    monkeypatch.setattr(engine, "_index", lambda action: None)
    restored: list[int] = []

    def restore_one(job_id, manifest, creds, cgroups, gpu_pairs=None):
        # the images put back, as before criu restores them
        images.download(engine.store, manifest, tmp_path / f"work-{manifest.seq}")
        restored.append(manifest.seq)
        return 4242, []

    monkeypatch.setattr(engine, "_restore_one", restore_one)

    result = engine.restore(JOB, os.getuid())

    assert (result["seq"], restored) == (1, [1])
    assert reads == [2, 1]  # each read once: the newest refused while it was written out
    assert [r["seq"] for r in result["refused"]] == [2]
    assert "no longer matches its hash" in result["refused"][0]["reason"]
    assert (tmp_path / "work-1/images/pages-1.img").read_bytes() == b"a" * 8192


class RecordingSlurm:
    def __init__(self, record: dict):
        self.record = record
        self.requeued: list[int] = []

    def job(self, job_id: int) -> dict:
        return self.record

    job_record = job

    def requeue(self, job_id: int) -> bool:
        self.requeued.append(job_id)
        return True


@pytest.mark.parametrize(("keep_excluded", "kept_off"), [
    (True, "n1,n3,n2"),  # a node whose GPUs cannot take the checkpoint adds to the nodes it avoids
    (False, "n2"),  # a migration leaves only the node it names
])
def test_a_requeue_keeps_the_job_off_the_nodes_it_avoided_already_when_told(
        tmp_path: Path, monkeypatch, keep_excluded: bool, kept_off: str) -> None:
    from singularity_slurm.config import parse
    from singularity_slurm.node import engine as engine_module

    slurm = RecordingSlurm({"Restarts": 2, "ExcNodeList": "n[1,3]"})
    engine = CheckpointEngine(parse({}), "n2", tmp_path / "run", CheckpointStore(tmp_path / "store"), None,
                              slurm)  # type: ignore[arg-type]
    (tmp_path / "run").mkdir()
    helpers: list[list[str]] = []
    monkeypatch.setattr(engine_module.subprocess, "Popen", lambda argv, **kwargs: helpers.append(argv))

    reply = engine.requeue(JOB, ["n2"], keep_excluded=keep_excluded)

    assert slurm.requeued == [JOB] and reply["exclude"] == kept_off.split(",")
    assert helpers[0][-1] == kept_off  # the helper that lifts the delay sets ExcNodeList to these


def test_the_generations_of_many_ranks_come_from_one_reading_of_their_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engines = rank_engines(tmp_path, 3)
    for engine in engines[:2]:
        commit_rank(engine, "1.1", bytes([engine.rank]) * 4096)
    commit_rank(engines[0], "1.2", b"z" * 4096)
    readings = []
    listing = CheckpointStore.list

    def counted(store: CheckpointStore, job_id: int) -> list:
        readings.append(job_id)
        return listing(store, job_id)

    monkeypatch.setattr(CheckpointStore, "list", counted)
    found = engines[0].rank_generations(JOB, list(range(4096)), RUN)

    assert readings == [JOB]  # not once per rank: a request naming 4096 ranks costs one listing
    assert (found["0"], found["1"], found["2"], found["4095"]) == (["1.1", "1.2"], ["1.1"], [], [])
    assert len(found) == 4096
