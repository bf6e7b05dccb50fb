"""torch's own model-averaging tests, run against our averagers.

The bodies are those of torch/testing/_internal/distributed/distributed_test.py (torch 2.13),
ported from NCCL on GPUs to gloo on CPU with 4 processes: `.cuda(...)` and `device_ids` dropped,
torch's `TestCase` asserts kept through a small shim; one body is corrected, where torch's never
used the class it names (see its comment). `averagers.PeriodicModelAverager` and
`hierarchicalSGD.HierarchicalModelAverager` name *our* classes here; every body also runs with
torch's classes, which shows the port is faithful. The bodies rebind `param.data` every step,
use mock gradients, torch's `PostLocalSGDOptimizer` and a `weights_only` reload.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import tempfile
import warnings
from collections import OrderedDict
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.algorithms.model_averaging.averagers as torch_averagers
import torch.distributed.algorithms.model_averaging.hierarchical_model_averager as torch_hier
import torch.distributed.optim.post_localSGD_optimizer as post_localSGD_optimizer
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.distributed_c10d import _get_pg_config

from localsgd.averaging import HierarchicalAverager, PeriodicAverager
from tests.helpers import run_distributed

pytestmark = pytest.mark.slow

IMPLEMENTATIONS = {
    "ours": (
        SimpleNamespace(PeriodicModelAverager=PeriodicAverager),
        SimpleNamespace(HierarchicalModelAverager=HierarchicalAverager),
    ),
    "torch": (torch_averagers, torch_hier),
}


class _FC2(nn.Module):  # distributed_test.py's, verbatim
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(10, 50, bias=True)
        self.fc.bias.requires_grad = False

    def forward(self, x):
        x = self.fc(x)
        return x


class Net(nn.Module):  # distributed_test.py's, verbatim
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = _FC2()
        self.fc3 = nn.Linear(50, 4, bias=False)
        self.relu = nn.ReLU()
        self.no_grad_param = nn.Parameter(torch.tensor([2, 2]).long(), requires_grad=False)

    def forward(self, x):
        x = self.relu(self.fc1(x))
        x = self.relu(self.fc2(x))
        x = self.fc3(x)
        return F.softmax(x, dim=1)


@contextlib.contextmanager
def _rank_temp_file():  # distributed_test.py's, plus a barrier before rank 0 removes the file
    if dist.get_rank() == 0:
        fd, name = tempfile.mkstemp()
        os.close(fd)
    else:
        name = None
    object_list = [name]
    dist.broadcast_object_list(object_list)
    name = object_list[0]
    try:
        yield name
    finally:
        dist.barrier()  # 4 CPU processes on 2 cores: another rank may not have read it yet
        if dist.get_rank() == 0:
            os.remove(name)


class _Case:
    """The parts of torch's `TestCase` the bodies use."""

    def __init__(self, rank: int, averagers, hierarchicalSGD):  # noqa: N803 (torch's names)
        self.rank = rank
        self.averagers, self.hierarchicalSGD = averagers, hierarchicalSGD

    def assertEqual(self, a, b):  # noqa: N802
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            torch.testing.assert_close(a, b, check_dtype=False)
        else:
            assert a == b, (a, b)

    def assertNotEqual(self, a, b):  # noqa: N802
        assert a != b, (a, b)

    def assertNotIn(self, a, b):  # noqa: N802
        assert a not in b

    @contextlib.contextmanager
    def assertWarnsRegex(self, expected_warning, expected_regex):  # noqa: N802
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
        assert any(
            issubclass(w.category, expected_warning) and re.search(expected_regex, str(w.message))
            for w in caught
        ), [str(w.message) for w in caught]

    def _barrier(self):
        dist.barrier()

    # ---- torch's bodies ------------------------------------------------------------------------

    def test_periodic_model_averager(self):
        averagers = self.averagers
        world_size = dist.get_world_size()
        rank = dist.get_rank()
        model = nn.Linear(1, 5, bias=False)
        param = next(model.parameters())
        tensor = torch.ones_like(param.data) * rank
        expected_avg_tensor = torch.ones_like(param.data) * sum(range(world_size)) / world_size
        period = 4
        for warmup_steps in [12, 13, 14, 15]:
            averager = averagers.PeriodicModelAverager(period=period, warmup_steps=warmup_steps)
            for step in range(20):
                # Reset the parameters at every step.
                param.data = copy.deepcopy(tensor)
                for params in model.parameters():
                    # mock grad
                    params.grad = torch.ones_like(param.data)
                averager.average_parameters(model.parameters())
                if step >= warmup_steps and (step - warmup_steps) % period == 0:
                    self.assertEqual(param.data, expected_avg_tensor)
                else:
                    # No model averaging, so the parameters are not updated.
                    self.assertEqual(param.data, tensor)

    def test_periodic_model_averager_param_group(self):
        averagers = self.averagers
        rank = dist.get_rank()
        world_size = dist.get_world_size()
        model = nn.Linear(1, 5, bias=False)
        param = next(model.parameters())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        period = 4
        for warmup_steps in [12, 13, 14, 15]:
            averager = averagers.PeriodicModelAverager(period=period, warmup_steps=warmup_steps)
            for step in range(20):
                # Reset the parameters at every step.
                for param_group in opt.param_groups:
                    for params in param_group["params"]:
                        # mock grad
                        params.grad = torch.ones_like(param.data) * rank
                        params.data = torch.ones_like(param.data) * rank
                averager.average_parameters(opt.param_groups)
                if step >= warmup_steps and (step - warmup_steps) % period == 0:
                    for param_group in opt.param_groups:
                        for params in param_group["params"]:
                            if params.grad is None:
                                continue
                            self.assertEqual(
                                param.data,
                                torch.ones_like(param.data) * sum(range(world_size)) / world_size,
                            )
                else:
                    # No model averaging, so the parameters are not updated.
                    for param_group in opt.param_groups:
                        for params in param_group["params"]:
                            if params.grad is None:
                                continue
                            self.assertEqual(param.data, torch.ones_like(param.data) * rank)

    def test_1_level_hierarchical_model_averager_equivalent_to_periodic_model_averager(self):
        # Corrected: torch's body builds the hierarchical averager, then rebinds `averager` to a
        # PeriodicModelAverager before the loop, so the class it names never averaged (only its
        # constructor ran). Here the hierarchical averager averages `model` while a periodic one
        # averages `twin` the same way, and the two must agree at every step. torch's warmups
        # 12..15 become 0, 4, 12: the hierarchical rule counts `step % period`, the periodic one
        # `(step - warmup_steps) % period`, so they are equivalent only when period divides the
        # warmup (as torch's own classes show on 13, 14 and 15).
        averagers, hierarchicalSGD = self.averagers, self.hierarchicalSGD  # noqa: N806
        rank = dist.get_rank()
        world_size = dist.get_world_size()
        model = nn.Linear(1, 5, bias=False)
        param = next(model.parameters())
        twin = nn.Linear(1, 5, bias=False)
        twin_param = next(twin.parameters())
        tensor = torch.ones_like(param.data) * rank
        expected_avg_tensor = torch.ones_like(param.data) * sum(range(world_size)) / world_size
        period = 4
        for warmup_steps in [0, 4, 12]:
            hierarchical = hierarchicalSGD.HierarchicalModelAverager(
                # Run the global averaging at a period of 4,
                # which is equivalent to the above periodic model averaging test case.
                period_group_size_dict=OrderedDict([(period, world_size)]),
                warmup_steps=warmup_steps,
            )
            periodic = averagers.PeriodicModelAverager(period=period, warmup_steps=warmup_steps)
            for step in range(20):
                # Reset the parameters at every step.
                param.data = copy.deepcopy(tensor)
                twin_param.data = copy.deepcopy(tensor)
                for params in (param, twin_param):
                    # mock grad
                    params.grad = torch.ones_like(params.data)
                hierarchical.average_parameters(model.parameters())
                periodic.average_parameters(twin.parameters())
                self.assertEqual(param.data, twin_param.data)
                if step >= warmup_steps and (step - warmup_steps) % period == 0:
                    self.assertEqual(param.data, expected_avg_tensor)
                else:
                    # No model averaging, so the parameters are not updated.
                    self.assertEqual(param.data, tensor)

    def test_3_level_hierarchical_model_averager(self):
        hierarchicalSGD = self.hierarchicalSGD  # noqa: N806
        rank = dist.get_rank()
        world_size = dist.get_world_size()
        model = nn.Linear(1, 5, bias=False)
        param = next(model.parameters())
        tensor = torch.ones_like(param.data) * rank
        # Set up such a hierarchical model averaging as follows:
        # after the first 10 warmup steps,
        # run model averaging every 2 steps within each subgroup of size 2,
        # run model averaging every 4 steps within each subgroup of size 3,
        # and run the global model averaging every 8 steps.
        # If there is a conflict in model averaging at a step, only run the highest-level one.
        warmup_steps = 10
        subgroup_size1 = 2
        subgroup_avg_period1 = 2
        subgroup_size2 = 4
        subgroup_avg_period2 = 4
        global_avg_period = 8
        period_group_size_dict = OrderedDict(
            [
                (subgroup_avg_period1, subgroup_size1),
                (subgroup_avg_period2, subgroup_size2),
                (global_avg_period, world_size),
            ]
        )
        pg_count = dist.get_pg_count()  # torch's body runs first in a fresh process; we do not
        averager = hierarchicalSGD.HierarchicalModelAverager(
            period_group_size_dict=period_group_size_dict, warmup_steps=warmup_steps
        )
        self.assertEqual(dist.get_pg_count() - pg_count + 1, len(period_group_size_dict))

        subgroup1 = averager.period_process_group_dict[subgroup_avg_period1]
        subgroup2 = averager.period_process_group_dict[subgroup_avg_period2]
        real_group_ranks_res1 = _get_pg_config(subgroup1)["ranks"]
        real_group_ranks_res2 = _get_pg_config(subgroup2)["ranks"]

        expect_group_ranks_res1 = (
            rank // subgroup_size1 * subgroup_size1 + np.array(list(range(subgroup_size1)))
        ).tolist()
        expect_group_ranks_res2 = (
            rank // subgroup_size2 * subgroup_size2 + np.array(list(range(subgroup_size2)))
        ).tolist()
        self.assertEqual(real_group_ranks_res1, expect_group_ranks_res1)
        self.assertEqual(real_group_ranks_res2, expect_group_ranks_res2)

        expected_avg_tensor_within_subgroup1 = (
            torch.ones_like(param.data) * sum(real_group_ranks_res1) / subgroup_size1
        )
        expected_avg_tensor_within_subgroup2 = (
            torch.ones_like(param.data) * sum(real_group_ranks_res2) / subgroup_size2
        )
        expected_global_avg_tensor = (
            torch.ones_like(param.data) * sum(range(world_size)) / world_size
        )
        for step in range(25):
            # Reset the parameters at every step.
            param.data = copy.deepcopy(tensor)
            for params in model.parameters():
                # mock grad
                params.grad = torch.ones_like(param.data)
            averager.average_parameters(model.parameters())
            if step == 16 or step == 24:
                # Run global model averaging when `step` can be divided by 8.
                self.assertEqual(param.data, expected_global_avg_tensor)
            elif step == 12 or step == 20:
                # averaging within subgroup when `step` can be divided by 4 but not by 8.
                self.assertEqual(param.data, expected_avg_tensor_within_subgroup2)
            elif step == 10 or step == 14 or step == 18 or step == 22:
                # averaging within subgroup when `step` can be divided by 2 but not by 4 or 8.
                self.assertEqual(param.data, expected_avg_tensor_within_subgroup1)
            else:
                # No model averaging, so the parameters are not updated.
                self.assertEqual(param.data, tensor)

    def _test_post_localSGD_optimizer_parity(self, create_averager, grad_is_view):  # noqa: N802
        learning_rate = 0.03

        DDP_NET = Net()  # noqa: N806
        net = torch.nn.parallel.DistributedDataParallel(
            copy.deepcopy(DDP_NET), gradient_as_bucket_view=grad_is_view
        )
        averager = create_averager()
        opt = torch.optim.SGD(net.parameters(), lr=learning_rate)

        net_using_post_localSGD_opt = torch.nn.parallel.DistributedDataParallel(
            copy.deepcopy(DDP_NET), gradient_as_bucket_view=grad_is_view
        )
        # Process group cannot be pickled in some environments,
        # so cannot deep copy an averager. See:
        # https://github.com/pytorch/pytorch/pull/74737#pullrequestreview-922487496
        averager2 = create_averager()
        post_localSGD_opt = self._create_post_localSGD_optimizer(
            net_using_post_localSGD_opt, learning_rate, averager2
        )

        input = torch.randn(dist.get_world_size() * 2, 2)
        target = torch.randn(dist.get_world_size() * 2, 4)
        loss_fn = nn.MSELoss()

        for _ in range(20):
            self._perform_a_train_step(opt, net, loss_fn, input, target)
            averager.average_parameters(net.parameters())

            self._perform_a_train_step(
                post_localSGD_opt, net_using_post_localSGD_opt, loss_fn, input, target
            )
            for p1, p2 in zip(
                net.parameters(), net_using_post_localSGD_opt.parameters(), strict=True
            ):
                self.assertEqual(p1.data, p2.data)

        # Also check if the built-in step counters are the same to prevent a bug like #74737.
        self.assertEqual(averager.step, averager2.step)

    def _create_periodic_model_averager(self):
        return self.averagers.PeriodicModelAverager(period=4, warmup_steps=10)

    def _create_post_localSGD_optimizer(self, net, learning_rate, averager):
        return post_localSGD_optimizer.PostLocalSGDOptimizer(
            optim=torch.optim.SGD(net.parameters(), lr=learning_rate), averager=averager
        )

    def _perform_a_train_step(self, optimizer, net, loss_fn, input, target):
        optimizer.zero_grad()
        output = net(input)
        loss = loss_fn(output, target)
        loss.backward()
        optimizer.step()

    def _test_post_localSGD_optimizer_step_reload(self, create_averager, chkpt_file):  # noqa: N802
        learning_rate = 0.03

        net_using_post_localSGD_opt = torch.nn.parallel.DistributedDataParallel(Net())

        averager = create_averager()
        post_localSGD_opt = self._create_post_localSGD_optimizer(
            net_using_post_localSGD_opt, learning_rate, averager
        )

        averager2 = create_averager()
        dummy_post_localSGD_opt = self._create_post_localSGD_optimizer(
            net_using_post_localSGD_opt, learning_rate, averager2
        )

        input = torch.randn(dist.get_world_size() * 2, 2)
        target = torch.randn(dist.get_world_size() * 2, 4)
        loss_fn = nn.MSELoss()

        for _ in range(20):
            self._perform_a_train_step(
                post_localSGD_opt, net_using_post_localSGD_opt, loss_fn, input, target
            )

        if self.rank == 0:
            torch.save({"optimizer_state_dict": post_localSGD_opt.state_dict()}, chkpt_file)

        dist.barrier()
        checkpoint = torch.load(chkpt_file, weights_only=True)  # torch's default, said explicitly
        dummy_post_localSGD_opt.load_state_dict(checkpoint["optimizer_state_dict"])

        # Check that we didn't hit the trivial case
        self.assertNotEqual(averager2.step, 0)
        # Check if dummy averager was initialized to a correct value
        self.assertEqual(averager.step, averager2.step)

        # Remove 'step' entry from a checkpoint.
        # And make sure it is not in the state dictionary
        del checkpoint["optimizer_state_dict"]["step"]
        self.assertNotIn("step", checkpoint["optimizer_state_dict"])

        # Check if checkpoint without a 'step' entry invokes a warning
        with self.assertWarnsRegex(
            expected_warning=UserWarning,
            expected_regex="Loaded state dict does not contain a step counter for an averager. "
            "Setting step counter to 0.",
        ):
            dummy_post_localSGD_opt.load_state_dict(checkpoint["optimizer_state_dict"])

        self.assertEqual(averager2.step, 0)

    def _create_hierarchical_model_averager(self):
        period_group_size_dict = OrderedDict([(2, 2), (4, dist.get_world_size())])
        return self.hierarchicalSGD.HierarchicalModelAverager(
            period_group_size_dict=period_group_size_dict, warmup_steps=4
        )

    def test_post_localSGD_optimizer_parity(self):
        self._test_post_localSGD_optimizer_parity(
            self._create_periodic_model_averager, grad_is_view=False
        )
        self._test_post_localSGD_optimizer_parity(
            self._create_periodic_model_averager, grad_is_view=True
        )

    def test_post_localSGD_optimizer_parity_with_hierarchical_sgd(self):
        self._test_post_localSGD_optimizer_parity(
            self._create_hierarchical_model_averager, grad_is_view=False
        )
        self._test_post_localSGD_optimizer_parity(
            self._create_hierarchical_model_averager, grad_is_view=True
        )

    def test_post_localSGD_optimizer_step_reload(self):
        with _rank_temp_file() as tmp_file:
            self._test_post_localSGD_optimizer_step_reload(
                self._create_periodic_model_averager, tmp_file
            )


TESTS = [
    "test_periodic_model_averager",
    "test_periodic_model_averager_param_group",
    "test_1_level_hierarchical_model_averager_equivalent_to_periodic_model_averager",
    "test_3_level_hierarchical_model_averager",
    "test_post_localSGD_optimizer_parity",
    "test_post_localSGD_optimizer_parity_with_hierarchical_sgd",
    "test_post_localSGD_optimizer_step_reload",
]


def _run_bodies(rank, world_size):
    """Every body, with torch's classes first (the port must pass with the reference itself),
    then ours; one set of 4 processes for all (starting them costs more than the bodies)."""
    outcome = {}
    for name in TESTS:
        for impl in ("torch", "ours"):
            torch.manual_seed(0)  # the same model and data on every rank, as torch's harness
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # torch's period=1 / DDP notices
                    getattr(_Case(rank, *IMPLEMENTATIONS[impl]), name)()
                outcome[name, impl] = "passed"
            except Exception as e:  # noqa: BLE001 - reported per body below
                outcome[name, impl] = f"{type(e).__name__}: {e}"
            dist.barrier()  # a failed body must not leave a rank inside the next one
    return outcome


@pytest.fixture(scope="module")
def outcomes():
    return run_distributed(_run_bodies, 4, timeout_s=120)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", TESTS)
def test_torch_reference_test_passes_with_our_averagers(outcomes, name):
    for rank, outcome in enumerate(outcomes):
        assert outcome[name, "torch"] == "passed", f"rank {rank}, torch: {outcome[name, 'torch']}"
        assert outcome[name, "ours"] == "passed", f"rank {rank}, ours: {outcome[name, 'ours']}"
