import pytest
import torch

from dflash.train.checkpoint import (
    BackgroundCheckpoints,
    ContractError,
    UnsafeCheckpointError,
    check_contract,
    latest_valid,
    load_state,
    save_checkpoint,
    verify,
)


def state(step):
    return {"model": {"w": torch.full((3,), float(step))}, "rng": torch.get_rng_state()}


def test_keeps_last_k_and_resumes_newest(tmp_path):
    for step in (100, 200, 300):
        save_checkpoint(tmp_path, step, state(step), {"epoch": 0}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000200", "step-00000300"]
    folder, meta = latest_valid(tmp_path)
    assert meta["step"] == 300
    assert torch.equal(load_state(folder)["model"]["w"], torch.full((3,), 300.0))


def test_corrupt_newest_is_reported_and_skipped(tmp_path, caplog):
    save_checkpoint(tmp_path, 1, state(1), {}, keep=3)
    newest = save_checkpoint(tmp_path, 2, state(2), {}, keep=3)
    data = bytearray((newest / "state.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (newest / "state.pt").write_bytes(bytes(data))
    folder, meta = latest_valid(tmp_path)
    assert meta["step"] == 1
    assert "step-00000002 is corrupt (state.pt sha256 mismatch)" in caplog.text


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda text: "", "SHA256SUMS does not list state.pt"),
        (lambda text: text[: len(text) // 3], "SHA256SUMS line 1 is malformed"),
        (lambda text: text.splitlines()[1] + "\n", "SHA256SUMS does not list state.pt"),
    ],
    ids=["emptied", "truncated", "a-line-lost"],
)
def test_a_damaged_checksum_list_vouches_for_nothing(tmp_path, caplog, damage, reason):
    save_checkpoint(tmp_path, 1, state(1), {}, keep=3)
    newest = save_checkpoint(tmp_path, 2, state(2), {}, keep=3)
    sums = newest / "SHA256SUMS"
    sums.write_text(damage(sums.read_text()))
    folder, meta = latest_valid(tmp_path)
    assert meta["step"] == 1
    assert f"step-00000002 is corrupt ({reason})" in caplog.text


def test_interrupted_write_is_invisible(tmp_path):
    save_checkpoint(tmp_path, 1, state(1), {}, keep=3)
    with pytest.raises(RuntimeError):
        save_checkpoint(tmp_path, 2, {"bad": _Unpicklable()}, {}, keep=3)
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000001"]
    assert latest_valid(tmp_path)[1]["step"] == 1
    assert latest_valid(tmp_path / "none") is None


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("cannot pickle")


def test_contract_mismatch_names_the_keys(tmp_path):
    check_contract({"block_size": 16}, {"block_size": 16}, tmp_path)
    with pytest.raises(ContractError, match=r"block_size: checkpoint 16 != now 8"):
        check_contract({"block_size": 16, "gamma": 7}, {"block_size": 8, "gamma": 7}, tmp_path)


def test_a_background_checkpoint_holds_the_state_as_it_was_when_saved(tmp_path):
    """The step goes on while the thread writes: the checkpoint must be the state at the save,
    not whatever the optimizer made of the live tensors since."""
    writer = BackgroundCheckpoints()
    live = state(1)
    writer.save(tmp_path, 1, live, {"epoch": 0}, keep=2)
    live["model"]["w"].add_(100.0)  # the next optimizer step, in place
    writer.save(tmp_path, 2, live, {"epoch": 0}, keep=2)  # waits for the first write
    writer.wait()
    assert torch.equal(load_state(tmp_path / "step-00000001")["model"]["w"], torch.ones(3))
    assert torch.equal(
        load_state(tmp_path / "step-00000002")["model"]["w"], torch.full((3,), 101.0)
    )
    folder, meta = latest_valid(tmp_path)  # sha256 hashed while writing matches the file
    assert folder.name == "step-00000002" and verify(folder) is None


def test_a_failed_background_write_raises_at_the_next_wait(tmp_path):
    writer = BackgroundCheckpoints()
    writer.save(tmp_path, 1, {"bad": _Unpicklable()}, {}, keep=2)
    with pytest.raises(RuntimeError, match="cannot pickle"):
        writer.wait()
    writer.wait()  # reported once
    assert latest_valid(tmp_path) is None


def test_the_state_a_trainer_writes_resumes_under_weights_only_loading(tmp_path):
    """What Trainer.checkpoint saves (weights, AdamW and its cosine schedule after a step, every
    drafter's RNG state) loads back whole with weights_only=True."""
    from dflash.train.optim import cosine_with_warmup

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup(10, 0.04))
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    saved = {
        "drafter": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": [torch.get_rng_state(), torch.get_rng_state()],
    }
    save_checkpoint(tmp_path, 1, saved, {"epoch": 0}, keep=1)
    loaded = load_state(tmp_path / "step-00000001")
    fresh = torch.optim.AdamW(torch.nn.Linear(4, 4).parameters(), lr=6e-4)
    fresh.load_state_dict(loaded["optimizer"])  # as Trainer.resume does
    assert loaded["scheduler"] == scheduler.state_dict()
    moment = optimizer.state[model.weight]["exp_avg"]
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"], moment)
    assert all(torch.equal(a, b) for a, b in zip(loaded["rng"], saved["rng"], strict=True))


class _RunsCode:
    """Unpickling this would open (create) a file: any callable could stand there."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_checkpoint_with_a_pickled_object_is_refused_without_running_it(tmp_path):
    """SHA256SUMS matches (the file is the one written beside it), yet the object is neither
    unpickled nor its code run: the error names the file, the object and what to do."""
    marker = tmp_path / "ran"
    folder = save_checkpoint(
        tmp_path / "ckpt", 5, {"model": state(5)["model"], "x": _RunsCode(marker)}, {}, keep=1
    )
    assert latest_valid(tmp_path / "ckpt")[0] == folder  # its sums verify
    with pytest.raises(UnsafeCheckpointError) as refused:
        load_state(folder)
    message = str(refused.value)
    assert f"cannot resume from {folder / 'state.pt'}" in message
    assert "pickled io.open" in message and f"Move {folder} away" in message
    assert not marker.exists()
