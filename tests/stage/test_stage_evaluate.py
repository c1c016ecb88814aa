"""stage.evaluate over real loopback sockets: forward only on the parameters of the version asked,
leaving parameters, gradient sums and claims untouched, and refusing what it cannot answer exactly
(a version this peer has not reached, one it no longer holds, malformed inputs)."""

from __future__ import annotations

import pytest
import torch
from waiting import until

from swarmd.directory import StaticDirectory
from swarmd.model import build_stage
from swarmd.stage import StageLimits
from transport.errors import RemoteError
from transport.rpc import Message

B, T, C = 2, 16, 32


def ids(seed: int, b: int = B) -> torch.Tensor:
    return torch.randint(0, 256, (b, T), generator=torch.Generator().manual_seed(seed))


def acts(seed: int, b: int = B) -> torch.Tensor:
    return torch.randn(b, T, C, generator=torch.Generator().manual_seed(seed))


async def evaluate(client, kit, peer, stage: int, version: int, tensors: list[torch.Tensor],
                   extra: dict | None = None) -> Message:
    meta = {**kit.meta(stage), "version": version, "samples": tensors[0].shape[0], **(extra or {})}
    return await client.call(peer.addr, "stage.evaluate", Message(meta, tensors, codec="none"), timeout=10)


def state_of(service) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in service.stage.named_parameters()}


async def test_evaluate_is_forward_only_and_leaves_parameters_sums_and_claims_alone(client, kit):
    """Steps: a 2-stage job, stage 0 and stage 1 each on a peer; the last stage sums one
    microbatch's gradient (forward_backward); then stage.evaluate on both with version 0, twice.
    Expected: stage 0 answers the module's own no-grad forward, the last stage the sample-summed
    loss its training call computes; every parameter bit-identical, the gradient sums exactly the
    one microbatch's (ids, samples and values), the first stage's sums still empty."""
    spec = kit.make_spec(stages=2)
    directory = StaticDirectory()
    limits = StageLimits(max_batch=1, sync_interval_s=60.0)
    first = await kit.start_peer(spec, 0, 1, directory, limits)
    last = await kit.start_peer(spec, 1, 2, directory, limits)
    try:
        h, targets = acts(3), ids(4)
        await kit.call(client, last, "stage.forward_backward", 1, 0, 1, [h, targets])
        before = [state_of(peer.service) for peer in (first, last)]
        ref0, ref1 = (build_stage(spec.model.config, i, 2, spec.seed) for i in range(2))
        x, hx, tx = ids(5), acts(6), ids(7)
        for _ in range(2):
            y = await evaluate(client, kit, first, 0, 0, [x])
            assert y.meta["version"] == 0
            with torch.no_grad():
                assert torch.equal(y.tensors[0], ref0(x))
            loss = await evaluate(client, kit, last, 1, 0, [hx, tx])
            assert loss.tensors == [] and loss.meta["version"] == 0
            with torch.no_grad():
                assert loss.meta["loss_sum"] == ref1(hx, tx).item()
        for peer, kept in zip((first, last), before):
            after = state_of(peer.service)
            assert all(torch.equal(after[n], kept[n]) for n in after)
            assert all(p.grad is None for p in peer.service.stage.parameters())
        assert first.service.accumulator.progress(0).ids == set()
        progress = last.service.accumulator.progress(0)
        assert progress.ids == {1} and progress.samples == B
        h_ref = h.clone().requires_grad_(True)
        ref1(h_ref, targets).backward()
        for p, g in zip(ref1.parameters(), last.service.accumulator.take(0).grads):
            assert torch.equal(p.grad, g)
        # No claim: microbatch 0 of step 0, never sent for training, is still taken for accumulation.
        reply = await kit.call(client, first, "stage.backward", 0, 0, 0, [x, acts(8)])
        assert reply.meta["added"] is True and reply.meta["duplicate"] is False
    finally:
        await first.close()
        await last.close()


async def test_evaluate_answers_the_version_asked_or_refuses(client, kit):
    """Steps: a 1-stage job of one microbatch per step on one peer; evaluate version 0, commit step
    0 (one forward_backward), evaluate versions 0 and 1, commit step 1, evaluate version 0 again.
    Expected: version 1 before the commit is not_ready; after it, version 0 is answered on the
    kept parameters of step 0 (the initial module's loss) and version 1 on the new ones (another
    loss); once step 1 commits too, version 0 is stale_step."""
    spec = kit.make_spec(global_samples=2, microbatch=2, stages=1)
    peer = await kit.start_peer(spec, 0, 1, StaticDirectory(), StageLimits(sync_interval_s=0.02))
    try:
        x, targets = ids(1), ids(2)
        with torch.no_grad():
            initial = build_stage(spec.model.config, 0, 1, spec.seed)(x, targets).item()
        assert (await evaluate(client, kit, peer, 0, 0, [x, targets])).meta["loss_sum"] == initial
        with pytest.raises(RemoteError) as refused:
            await evaluate(client, kit, peer, 0, 1, [x, targets])
        assert refused.value.code == "not_ready"

        await kit.call(client, peer, "stage.forward_backward", 0, 0, 0, [x, targets])
        await until(lambda: peer.service.committed == 1, 10, "step 0 to commit")
        assert (await evaluate(client, kit, peer, 0, 0, [x, targets])).meta["loss_sum"] == initial
        trained = (await evaluate(client, kit, peer, 0, 1, [x, targets])).meta["loss_sum"]
        assert trained != initial

        await kit.call(client, peer, "stage.forward_backward", 0, 1, 1, [x, targets])
        await until(lambda: peer.service.committed == 2, 10, "step 1 to commit")
        with pytest.raises(RemoteError) as refused:
            await evaluate(client, kit, peer, 0, 0, [x, targets])
        assert refused.value.code == "stale_step"
    finally:
        await peer.close()


@pytest.mark.parametrize("meta, tensors, words", [
    ({"version": -1}, "ok", "'version' >= 0"),
    ({"version": "0"}, "ok", "'version' >= 0"),
    ({"samples": 3}, "ok", "samples is 3"),
    ({}, "no targets", "takes 2 tensor(s)"),
    ({}, "float ids", "expected dtype torch.int64"),
])
async def test_malformed_evaluate_calls_are_bad_input(client, kit, meta, tensors, words):
    spec = kit.make_spec(stages=1)
    peer = await kit.start_peer(spec, 0, 1, StaticDirectory(), StageLimits(sync_interval_s=60.0))
    try:
        x, targets = ids(1), ids(2)
        sent = {"ok": [x, targets], "no targets": [x], "float ids": [x.float(), targets]}[tensors]
        with pytest.raises(RemoteError) as refused:
            await evaluate(client, kit, peer, 0, 0, sent, meta)
        assert refused.value.code == "bad_input" and words in refused.value.message, refused.value
    finally:
        await peer.close()
