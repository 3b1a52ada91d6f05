"""Gradient accumulation: k micro-batches equal one step on their concatenation.

Three ways, each against the unsharded model trained on the global batch (5
AdamW steps, 2 micro-batches per step): torch_xla's and Accelerate's
`model.no_sync()` (no communication, full gradients accumulate), FSDP2's
`set_requires_gradient_sync(False)` (the same), and plain repeated backward
(each micro-batch reduce-scatters; shard gradients accumulate). gloo world 2
and 4 here; the single-controller runtime at 4 and 8 devices in
tests/test_single_controller.py.
"""
import pytest
import torch

from parity_cases import Case, assemble, assert_rel_close, run_accumulated, train_reference

MODES = ["no_sync", "requires_sync", "shards"]
CASES = [Case("gpt2_acc", "gpt2", "adamw"), Case("mlp_acc_hybrid", "mlp_nested", "adamw", worlds=(4,),
                                                    fsdp=(("sharding_strategy", "HYBRID_SHARD"),
                                                          ("sharding_groups", [[0, 1], [2, 3]])))]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return {world: run_accumulated([c for c in CASES if world in c.worlds], MODES, world,
                                   str(tmp_path_factory.mktemp(f"acc{world}"))) for world in (2, 4)}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case,world", [(c, w) for c in CASES for w in c.worlds],
                         ids=lambda x: x.name if isinstance(x, Case) else f"w{x}")
def test_accumulated_micro_batches_equal_one_step(results, case, world, mode):
    ranks = [r[(case.name, mode)] for r in results[world]]
    ref = train_reference(case)
    torch.testing.assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
    for group in ranks[0]["groups"]:
        rebuilt = assemble(ref["params"], [r["shards"] for r in ranks], group)
        for name, full in ref["params"].items():
            assert_rel_close(rebuilt[name], full, 1e-5, f"{mode} world {world} {name}")
