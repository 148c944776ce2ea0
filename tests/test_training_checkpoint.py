"""Resumable checkpoints: only complete directories count; a round trip restores state exactly."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from hlmtune.training import checkpoint as ckpt


def test_latest_checkpoint_ignores_partial_and_incomplete(tmp_path):
    root = ckpt.checkpoint_root(tmp_path)
    assert ckpt.latest_checkpoint(tmp_path) is None
    for name, complete in [("step_5", True), ("step_10", True), ("step_15.partial", True), ("step_20", False), ("junk", True)]:
        d = root / name
        d.mkdir(parents=True)
        if complete:
            (d / ckpt.STATE_FILE).write_text("{}")
    assert ckpt.latest_checkpoint(tmp_path) == root / "step_10"


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_round_trip_restores_weights_optimizer_scheduler_and_data_position(one_rank_group, tmp_path):
    from torchdata.stateful_dataloader import StatefulDataLoader

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    model[0].requires_grad_(False)  # frozen: not stored
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    loader = StatefulDataLoader(list(range(20)), batch_size=2)
    it = iter(loader)
    for _ in range(3):
        next(it)
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        sched.step()
    path = ckpt.save_training_state(output_dir=tmp_path, model=model, optimizer=opt, lr_scheduler=sched,
                                    dataloader=loader, recipe_state={"global_step": 3, "epochs_run": 0, "step_in_epoch": 3})
    assert path.name == "step_3" and json.loads((path / "state.json").read_text())["global_step"] == 3
    saved = torch.load(path / "trainable.pt", weights_only=True)
    assert set(saved) == {"1.weight", "1.bias"}
    expected_next = next(it)

    model2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    model2[0].load_state_dict(model[0].state_dict())
    model2[0].requires_grad_(False)
    opt2 = torch.optim.AdamW([p for p in model2.parameters() if p.requires_grad], lr=0.1)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    loader2 = StatefulDataLoader(list(range(20)), batch_size=2)
    state = ckpt.load_training_state(path, model=model2, optimizer=opt2, lr_scheduler=sched2, dataloader=loader2)
    assert state["step_in_epoch"] == 3
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert torch.equal(next(iter(loader2)), expected_next)


def test_an_epoch_end_checkpoint_starts_the_next_epoch_afresh(one_rank_group, tmp_path):
    """Saved after an epoch cut short (max_steps_per_epoch), the next epoch after resuming is that
    epoch's own shuffled pass, as in the run that was not stopped, not the rest of the old one."""
    from torch.utils.data.distributed import DistributedSampler
    from torchdata.stateful_dataloader import StatefulDataLoader

    def loader():
        data = list(range(20))
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
        return StatefulDataLoader(data, batch_size=2, sampler=sampler), sampler

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()  # optimizer state to save
    dl, sampler = loader()
    sampler.set_epoch(0)
    it = iter(dl)
    for _ in range(3):  # epoch 0 stops after 3 of its 10 batches
        next(it)
    path = ckpt.save_training_state(output_dir=tmp_path, model=model, optimizer=opt, lr_scheduler=None,
                                    dataloader=dl, recipe_state={"global_step": 3, "epochs_run": 1, "step_in_epoch": 0})
    sampler.set_epoch(1)
    uninterrupted = [b.tolist() for b in dl][:3]

    dl2, sampler2 = loader()
    ckpt.load_training_state(path, model=model, optimizer=opt, lr_scheduler=None, dataloader=dl2)
    sampler2.set_epoch(1)
    it2 = iter(dl2)
    assert [next(it2).tolist() for _ in range(3)] == uninterrupted


def test_missing_file_is_named(one_rank_group, tmp_path):
    d = ckpt.checkpoint_root(tmp_path) / "step_1"
    d.mkdir(parents=True)
    (d / ckpt.STATE_FILE).write_text(json.dumps({"global_step": 1}))
    with pytest.raises(FileNotFoundError, match="trainable.pt"):
        ckpt.load_training_state(d, model=torch.nn.Linear(1, 1), optimizer=None, lr_scheduler=None, dataloader=None)
