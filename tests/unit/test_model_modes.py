"""Train and eval mode of exported graphs (model_modes), against torch's own modules.

A graph captured in one mode, switched to the other, must compute what the
original ``nn.Module`` computes in that mode, share its parameters and buffers,
and refuse what it cannot switch.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import fx, nn

from collectives.errors import FailedPrecondition
from collectives_server.worker.models import modes as model_modes


def _captured(module: nn.Module, x: torch.Tensor) -> nn.Module:
    program = torch.export.export(module, (x,), dynamic_shapes=({0: torch.export.Dim.DYNAMIC},))
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    return torch.export.load(buffer).module()


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 12), nn.Dropout(0.5), nn.BatchNorm1d(12), nn.RReLU(), nn.Linear(12, 3)
    )


def test_a_graph_captured_in_train_mode_runs_in_eval_mode_as_torch_does() -> None:
    x = torch.randn(10, 6)
    module = _model()
    graph = _captured(module, x)
    assert model_modes.captured_mode(graph) is True
    evaluating = model_modes.for_mode(graph, False, "m")
    module.eval()
    torch.testing.assert_close(evaluating(x), module(x), rtol=0, atol=0)
    assert torch.equal(evaluating(x), evaluating(x))  # dropout and rrelu are off
    # The buffers are shared and eval mode leaves them alone.
    tracked = dict(graph.named_buffers())["2.num_batches_tracked"].clone()
    evaluating(x)
    assert torch.equal(dict(graph.named_buffers())["2.num_batches_tracked"], tracked)
    assert (
        dict(evaluating.named_parameters())["0.weight"]
        is dict(graph.named_parameters())["0.weight"]
    )
    training = model_modes.for_mode(graph, True, "m")  # torch's input checks put back
    assert (
        dict(training.named_buffers())["2.running_var"]
        is dict(graph.named_buffers())["2.running_var"]
    )
    torch.testing.assert_close(training(x[:4]).shape, module.train()(x[:4]).shape)
    plain = _captured(nn.Sequential(nn.Linear(6, 3), nn.ReLU()), x)
    assert model_modes.for_mode(plain, True, "m") is plain  # nothing to switch or check


def test_a_graph_captured_in_eval_mode_runs_batch_norm_on_the_batch_in_train_mode() -> None:
    x = torch.randn(8, 6)
    torch.manual_seed(1)
    module = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.InstanceNorm1d(5, True, True))
    module.eval()
    graph = _captured(module, x)
    assert model_modes.captured_mode(graph) is False
    training = model_modes.for_mode(graph, True, "m")
    reference = nn.Sequential(*[m for m in module]).train()
    before = module[1].running_mean.clone()
    torch.testing.assert_close(training(x), reference(x.clone()))
    assert not torch.equal(dict(graph.named_buffers())["1.running_mean"], before)


def test_factory_modules_switch_with_train() -> None:
    module = _model()
    assert model_modes.for_mode(module, False, "m") is module and not module.training
    assert model_modes.captured_mode(module) is False


def test_an_unknown_mode_dependent_operator_is_refused() -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    out = graph.call_function(torch.ops.aten.native_dropout.default, (x, 0.5, True))
    graph.output(out)
    module = fx.GraphModule(nn.Module(), graph)
    with pytest.raises(FailedPrecondition, match="native_dropout"):
        model_modes.for_mode(module, False, "odd")


@pytest.mark.parametrize("captured_in_train", [True, False])
def test_a_train_mode_graph_refuses_one_value_per_channel_as_torch_does(
    captured_in_train: bool,
) -> None:
    """A captured graph calls aten.batch_norm without torch.nn.functional's check: one
    row in train mode would write NaN into running_var. The train-mode graph gives
    torch's ValueError back, and restoring_buffers undoes an earlier layer's update."""
    torch.manual_seed(5)
    module = nn.Sequential(
        nn.Linear(6, 4), nn.BatchNorm1d(4), nn.Unflatten(1, (4, 1)), nn.BatchNorm1d(4)
    )
    module.train(captured_in_train)
    graph = _captured(module, torch.randn(5, 6))
    training = model_modes.for_mode(graph, True, "m")
    one_row = torch.randn(1, 6)
    with pytest.raises(ValueError) as torch_said:
        module.train()(one_row)
    before = {k: v.clone() for k, v in graph.named_buffers()}
    with pytest.raises(ValueError) as ours, model_modes.restoring_buffers(graph, True):
        training(one_row)
    assert str(ours.value) == str(torch_said.value)
    for key, value in graph.named_buffers():
        assert torch.equal(value, before[key]), key  # nothing changed, no NaN
    # Three-dimensional input: one row but two values per channel is what torch allows.
    ok = nn.Sequential(nn.Linear(6, 8), nn.Unflatten(1, (4, 2)), nn.BatchNorm1d(4))
    graph = _captured(ok.train(captured_in_train), torch.randn(5, 6))
    got = model_modes.for_mode(graph, True, "m")(one_row)
    torch.testing.assert_close(got, ok.train()(one_row))


def test_instance_norm_on_one_spatial_element_is_refused_in_train_mode() -> None:
    module = nn.Sequential(nn.Unflatten(1, (3, 2)), nn.InstanceNorm1d(3, track_running_stats=True))
    graph = _captured(module.eval(), torch.randn(4, 6))
    training = model_modes.for_mode(graph, True, "m")
    torch.testing.assert_close(training(x := torch.randn(4, 6)), module.train()(x))
    narrow = nn.Sequential(nn.Unflatten(1, (6, 1)), nn.InstanceNorm1d(6, track_running_stats=True))
    graph = _captured(narrow.eval(), torch.randn(4, 6))
    with pytest.raises(ValueError, match="more than 1 spatial element"):
        model_modes.for_mode(graph, True, "m")(torch.randn(4, 6))


def test_a_graph_captured_in_eval_mode_counts_batches_in_train_mode() -> None:
    """An eval-mode capture holds no ``num_batches_tracked += 1``: train mode adds it."""
    torch.manual_seed(2)
    module = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4)).eval()
    graph = _captured(module, torch.randn(5, 6))
    training = model_modes.for_mode(graph, True, "m")
    x = torch.randn(5, 6)
    torch.testing.assert_close(training(x), module.train()(x))
    got = dict(graph.named_buffers())
    for key, want in module.named_buffers():
        torch.testing.assert_close(got[key], want, rtol=1e-6, atol=1e-7)
    assert int(got["1.num_batches_tracked"]) == 1


_PAIRS = nn.Unflatten(1, (2, 3))  # 6 features as 2 channels of 3 (instance norm's input)


class _Ema(nn.Module):
    """A layer that keeps a running average of its input in a buffer (written in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("average", torch.zeros(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.average.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return x - self.average


@pytest.mark.parametrize(
    ("make", "keeps"),
    [
        (lambda: nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6)), True),
        (lambda: nn.Sequential(nn.BatchNorm1d(6, track_running_stats=False)), False),
        (lambda: nn.Sequential(_PAIRS, nn.InstanceNorm1d(2, track_running_stats=True)), True),
        (lambda: nn.Sequential(_PAIRS, nn.InstanceNorm1d(2)), False),
        (lambda: nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.5)), False),
    ],
)
def test_a_model_that_keeps_running_statistics_is_told_from_one_that_does_not(make, keeps) -> None:
    """Running statistics (batch or instance norm that tracks them) are each worker's
    own after a train-mode call: found in a plain module and in its captured graph."""
    x = torch.randn(8, 6)
    assert model_modes.keeps_running_statistics(make().train()) is keeps
    assert model_modes.keeps_running_statistics(_captured(make().train(), x)) is keeps
    assert model_modes.keeps_running_statistics(_captured(make().eval(), x)) is keeps


def test_a_graph_that_writes_a_buffer_in_place_keeps_running_statistics() -> None:
    """Any buffer a captured graph writes in place moves with the worker's own shards."""
    x = torch.randn(8, 6)
    assert model_modes.keeps_running_statistics(_captured(_Ema().train(), x))
    assert not model_modes.keeps_running_statistics(_captured(_Ema().eval(), x))


def test_a_cumulative_average_batch_norm_captured_in_eval_mode_is_not_trained_wrong() -> None:
    """``BatchNorm(momentum=None)`` updates with 1/batches seen, but in eval mode its
    call holds momentum 0.0: switched to train mode it updated nothing. Such a graph
    is refused in train mode; one with a momentum trains as torch does."""
    x = torch.randn(10, 6)
    cumulative = nn.Sequential(nn.BatchNorm1d(6, momentum=None), nn.Linear(6, 3)).eval()
    with pytest.raises(FailedPrecondition, match="momentum is None"):
        model_modes.for_mode(_captured(cumulative, x), True, "m")
    torch.manual_seed(0)
    module = nn.Sequential(nn.BatchNorm1d(6, momentum=0.3), nn.Linear(6, 3)).eval()
    training = model_modes.for_mode(_captured(module, x), True, "m")
    training(x)
    module.train()(x)
    torch.testing.assert_close(
        dict(training.named_buffers())["0.running_mean"], module[0].running_mean
    )
