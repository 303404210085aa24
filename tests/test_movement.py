"""Data movement inside fused kernels: cat, constant padding, flip, repeat and the pieces of
split/chunk/unbind are read through by the kernel that consumes them (no copy is made), with
every input read at an index inside it. Structure and numerics, eval and training."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import opfuse
from tests.conftest import Fn, assert_matches_eager


def compiled(fn, *args):  # type: ignore[no-untyped-def]
    m = Fn(fn).eval()
    fast = opfuse.compile(m, args)
    assert_matches_eager(m, fast(*args), args)
    return fast.report


def test_rotary_embedding_is_one_kernel() -> None:
    # chunk -> neg -> cat -> mul/add: the rotation every LLaMA-style attention applies
    def rope(x, cos, sin):  # type: ignore[no-untyped-def]
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat((-x2, x1), -1) * sin

    r = compiled(rope, torch.randn(2, 4, 16, 32), torch.randn(16, 32), torch.randn(16, 32))
    assert r.kernels_after == 1
    assert r.kernels_before == 5  # neg, cat, mul, mul, add (the chunk is views)
    assert {"neg", "mul", "add"} <= {o.split(".")[1] for o in r.groups[0].ops}
    assert r.groups[0].reads_through == ["aten.cat.default"]


def test_cat_along_channels_feeds_the_activation() -> None:
    r = compiled(
        lambda a, b, c: torch.cat([a.relu(), b * 2, c], 1).sigmoid(),
        torch.randn(2, 3, 5, 7),
        torch.randn(2, 4, 5, 7),
        torch.randn(2, 1, 5, 7),
    )
    assert r.kernels_after == 1 and r.groups[0].pattern == "elementwise"


def test_cat_of_strided_mixed_dtype_and_empty_inputs() -> None:
    def f(a, b, e):  # type: ignore[no-untyped-def]
        return torch.cat([a.t(), b, e], 0) + 1  # int64 b promotes; torch skips empty [0]

    compiled(f, torch.randn(3, 6), torch.arange(6).view(2, 3), torch.empty(0))


def test_reduction_over_a_concatenated_dimension() -> None:
    r = compiled(
        lambda a, b: torch.cat([a, b.exp()], -1).softmax(-1),
        torch.randn(4, 9),
        torch.randn(4, 20),
    )
    assert r.kernels_after == 1 and r.groups[0].pattern == "reduction"


@pytest.mark.parametrize(
    "pad",
    [(0, 0, 1, 2), (0, 0, 2, 0, 0, 3), (0, 0, -1, 2, 1, -2), (0, 0, 5, 5, 1, 1, 1, 0)],
)
def test_constant_pad_fuses_with_producer_and_consumer(pad: tuple[int, ...]) -> None:
    r = compiled(
        lambda x: F.pad(x.sigmoid(), pad, value=-0.5) * 3,
        torch.randn(2, 3, 6, 5),
    )
    assert r.kernels_after == 1


def test_pad_of_a_channels_last_image_is_read_through() -> None:
    x = torch.randn(2, 8, 6, 5).to(memory_format=torch.channels_last)
    r = compiled(lambda x: F.pad(x.relu(), (1, 1, 2, 0)) * 2, x)
    assert r.kernels_after == 1


def test_pad_along_contiguous_rows_cuts_the_vector_loop() -> None:
    # read through, the clamped index gathered lane by lane (0.53x eager's pad then ReLU);
    # the loop over a row now runs as three pieces: left border, the row, right border;
    # the padded rows above and below are cases of their own (lower/unswitch.py)
    x = torch.randn(2, 3, 6, 5)
    m = Fn(lambda x: F.pad(x.relu(), (1, 2, 1, 1)) * 2).eval()
    fast = opfuse.compile(m, (x,))
    assert_matches_eager(m, fast(x), (x,))
    assert fast.report.kernels_after == 1
    src = fast._first.compiled.source
    assert src.count("#pragma omp simd") == 1 + 3 + 1
    assert not re.search(r"\(x2[^)]*\) < 0", src)  # no clamp left on the row's index


@pytest.mark.parametrize("dim", [-1, 1])
def test_cat_along_rows_reads_each_input_in_its_own_piece(dim: int) -> None:
    xs = (torch.randn(4, 7, 33), torch.randn(4, 7, 100).transpose(1, 2)[:, :7].transpose(1, 2))
    xs = (xs[0], xs[1], torch.randn(4, 7, 1)) if dim == -1 else (xs[0], xs[0][:, :2])
    m = Fn(lambda *xs: torch.cat([x.sigmoid() for x in xs], dim) * 3).eval()
    fast = opfuse.compile(m, xs)
    assert_matches_eager(m, fast(*xs), xs)
    assert fast.report.kernels_after == 1
    src = fast._first.compiled.source
    # along rows: three pieces of the vector loop; along an outer dim: two cases
    assert src.count("#pragma omp simd") == (3 if dim == -1 else 2)


@pytest.mark.parametrize(
    "f",
    [
        lambda x: F.pad(x, (2, 1)).flip(-1) * 2,  # the position runs backwards
        lambda x: F.pad(x, (-2, 3), value=1.5).exp(),  # a crop on one side
        lambda x: torch.cat([x[..., 3:], x.flip(-1), x[..., :1]], -1).tanh(),
        lambda x: F.pad(torch.cat([x, x.cos()], -1), (1, 1, 0, 1)) - 1,  # nested
    ],
)
def test_pieces_of_a_row_match_eager(f) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(3, 4, 9)
    m = Fn(f).eval()
    fast = opfuse.compile(m, (x,))
    assert_matches_eager(m, fast(x), (x,))
    assert fast.report.kernels_after == 1
    assert fast._first.compiled.source.count("#pragma omp simd") >= 2


def test_pad_of_an_integer_tensor_keeps_its_dtype() -> None:
    r = compiled(lambda x: F.pad(x + 1, (0, 0, 2, 1), value=7) * 2, torch.randint(0, 9, (3, 4)))
    assert r.kernels_after == 1


def test_flip_and_repeat_read_through() -> None:
    r = compiled(
        lambda x, w: (x.flip(-1, 0) + w.repeat(3, 2)).relu(),
        torch.randn(6, 8),
        torch.randn(2, 4),
    )
    assert r.kernels_after == 1
    assert r.kernels_before == 4


@pytest.mark.parametrize(
    "shifts, dims", [((2, -3), (1, 2)), ((5,), ()), ((-1,), (-1,)), ((9, 0), (0, 1))]
)
def test_roll_is_read_through(shifts: tuple[int, ...], dims: tuple[int, ...]) -> None:
    # a shifted-window attention rolls its windows there and back
    r = compiled(lambda x: torch.roll(x.sigmoid(), shifts, dims) * 2 + x, torch.randn(3, 5, 7))
    assert r.kernels_after == 1 and r.kernels_before == 4


def test_unbind_and_split_pieces_fuse() -> None:
    def f(x):  # type: ignore[no-untyped-def]
        a, b, c = x.unbind(1)
        p, q = x.split([1, 2], 1)
        return a * b + c, p.sum(1) + q.amax(1)

    r = compiled(f, torch.randn(5, 3, 7))
    assert all(g.pattern != "fallback" for g in r.groups)


def test_movement_read_whole_is_one_copy_kernel() -> None:
    # a cat and a flip between two library calls: torch copied each (two passes); one copy
    # kernel now reads through both
    r = compiled(
        lambda x, y: torch.cat([x @ y, y], 0).flip(0) @ y, torch.randn(8, 8), torch.randn(8, 8)
    )
    assert not [g for g in r.groups if "copied with torch" in g.reason]
    assert [g.pattern for g in r.groups] == ["library", "elementwise", "library"]
    assert r.groups[1].ops == ["aten.clone.default"]
    assert r.kernels_before == 4 and r.kernels_after == 3


def test_upsampled_skip_concatenation_is_one_pass() -> None:
    # a UNet decoder's input: torch upsampled, then concatenated (two copies of the big map)
    conv = torch.nn.Conv2d(8, 4, 3, padding=1)
    r = compiled(
        lambda x, s: conv(torch.cat([F.interpolate(x, scale_factor=2), s.relu()], 1)),
        torch.randn(2, 4, 6, 5),
        torch.randn(2, 4, 12, 10),
    )
    assert r.kernels_after == 2
    assert not [g for g in r.groups if g.pattern == "fallback"]
    assert set(r.groups[0].reads_through) == {
        "aten.cat.default",
        "aten.upsample_nearest2d.default",
    }
    assert "reads through: cat, upsample_nearest2d" in str(r)


def test_copy_no_kernel_can_read_through_gets_no_copy_kernel() -> None:
    # nearest upsampling by 3 is torch's kernel; a copy kernel after it would only copy
    conv = torch.nn.Conv2d(4, 4, 3, padding=1)
    r = compiled(lambda x: conv(F.interpolate(x, scale_factor=3)), torch.randn(2, 4, 6, 5))
    assert r.kernels_before == r.kernels_after == 2
    assert not any("aten.clone.default" in g.ops for g in r.groups)


def test_cat_and_pad_under_training() -> None:
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 6))

        def forward(self, x):  # type: ignore[no-untyped-def]
            y = torch.cat([x * self.w, x.tanh()], -1)
            return torch.roll(F.pad(y, (1, 1)).flip(-1), 3, 0).sigmoid().sum()

    torch.manual_seed(0)
    m = M()
    x = torch.randn(4, 6, requires_grad=True)
    ref = m(x)
    ref.backward()
    gw, gx = m.w.grad.clone(), x.grad.clone()
    m.w.grad = None
    x.grad = None
    out = torch.compile(m, backend="opfuse")(x)
    out.backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(m.w.grad, gw)
    torch.testing.assert_close(x.grad, gx)


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    data=st.data(),
)
def test_random_movement_chains(shape: list[int], data: st.DataObject) -> None:
    """A random op from {cat, pad, flip, repeat, split} between pointwise ops, over inputs
    that may be transposed."""
    n = len(shape)
    dim = data.draw(st.integers(0, n - 1))
    kind = data.draw(st.sampled_from(["cat", "pad", "flip", "repeat", "split", "roll"]))
    x = torch.randn(*shape)
    if data.draw(st.booleans()) and n >= 2:
        x = x.transpose(0, n - 1).contiguous().transpose(0, n - 1)  # same shape, strided
    other_len = data.draw(st.integers(1, 5))
    other = torch.randn(*[other_len if d == dim else s for d, s in enumerate(shape)])
    pads = [data.draw(st.integers(-1, 3)) for _ in range(2 * data.draw(st.integers(1, n)))]
    pads = [
        p if shape[n - 1 - j // 2] + sum(pads[2 * (j // 2) : 2 * (j // 2) + 2]) > 0 else 0
        for j, p in enumerate(pads)
    ]
    reps = [data.draw(st.integers(1, 3)) for _ in range(n + data.draw(st.integers(0, 1)))]

    def f(x, other):  # type: ignore[no-untyped-def]
        y = x.sin()
        if kind == "cat":
            y = torch.cat([y, other.relu()], dim)
        elif kind == "pad":
            y = F.pad(y, pads, value=0.25)
        elif kind == "flip":
            y = y.flip(dim)
        elif kind == "repeat":
            y = y.repeat(*reps)
        elif kind == "roll":
            y = torch.roll(y, pads[0] * 3 - 2, dim)
        else:
            parts = y.split(max(1, shape[dim] // 2), dim)
            y = parts[-1] * 2
        return y * 1.5 + 0.5, y.sum(-1)

    r = compiled(f, x, other)
    assert r.kernels_after < r.kernels_before or r.kernels_before <= 2
    # nothing runs with torch but a pad or cat along contiguous rows (measured slower)
    assert all(g.pattern != "fallback" or "copied with torch" in g.reason for g in r.groups)
    assert math.isfinite(r.kernels_before)


def test_a_cat_of_many_inputs_is_copied_once() -> None:
    # every input would be read at every position: beyond 8 inputs torch copies the cat
    xs = [torch.randn(2, i + 1, 3) for i in range(10)]
    r = compiled(lambda *xs: torch.cat([x.relu() for x in xs], 1) * 2, *xs)
    assert any("copied with torch" in g.reason for g in r.groups)
    r = compiled(lambda *xs: torch.cat([x.relu() for x in xs[:8]], 1) * 2, *xs[:8])
    assert r.kernels_after == 1


def test_nearest_upsampling_by_two_is_read_through() -> None:
    # an FPN's top-down path: upsample the coarser map, add the lateral one
    r = compiled(
        lambda top, lateral: F.interpolate(top.relu(), scale_factor=2) + lateral,
        torch.randn(2, 4, 5, 6),
        torch.randn(2, 4, 10, 12),
    )
    assert r.kernels_after == 1 and r.kernels_before == 3
    x = torch.randn(2, 8, 5, 6).to(memory_format=torch.channels_last)
    r = compiled(lambda x, y: F.interpolate(x, size=(20, 12)) * y, x, torch.randn(2, 8, 20, 12))
    assert r.kernels_after == 1


@pytest.mark.parametrize("size", [(15, 18), (9, 7), (10, 9)])
def test_other_nearest_sizes_run_torchs_kernel(size: tuple[int, int]) -> None:
    # floor(dst * in/out) in float: only powers of two are read through (dst // k)
    r = compiled(lambda x: F.interpolate(x, size=size) * 2, torch.randn(2, 3, 5, 6))
    assert not any("index" in g.kernel for g in r.groups)  # torch's upsampling, not a gather
    before = set(torch.ops.aten.upsample_nearest2d.default.py_kernels)
    assert torch._C.DispatchKey.Autograd in before  # torch's own kernels are put back


@pytest.mark.parametrize(
    "mode, size",
    [("bilinear", (9, 14)), ("bicubic", (10, 12)), ("nearest-exact", (7, 9)), ("area", (3, 3))],
)
def test_other_upsampling_modes_run_torchs_kernel(mode: str, size: tuple[int, int]) -> None:
    # their decompositions gather with index tensors: bilinear ran 7-50x slower than torch
    def f(x):  # type: ignore[no-untyped-def]
        return F.interpolate(x.relu(), size=size, mode=mode) * 2

    r = compiled(f, torch.randn(2, 3, 5, 6))
    assert not any("index" in g.kernel for g in r.groups)


def test_upsampling_trains_through_torchs_kernels() -> None:
    class Up(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

        def forward(self, x):  # type: ignore[no-untyped-def]
            y = F.interpolate(self.conv(x), scale_factor=2, mode="bilinear")
            z = F.interpolate(x, size=(13, 9), mode="nearest")
            return y.relu().sum() + z.sigmoid().sum()

    torch.manual_seed(0)
    m = Up()
    x = torch.randn(2, 3, 6, 5)
    ref = m(x)
    ref.backward()
    grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    out = torch.compile(m, backend="opfuse")(x)
    out.backward()
    torch.testing.assert_close(out, ref)
    for p, g in zip(m.parameters(), grads):
        torch.testing.assert_close(p.grad, g)


@pytest.mark.parametrize(
    "f",
    [
        lambda x: F.pad(x, (2, 1, 1, 2), mode="reflect"),
        lambda x: F.pad(x, (2, 1, 1, 2), mode="replicate"),
        lambda x: F.unfold(x, 3, padding=1),
        lambda x: F.fold(F.unfold(x, 2, stride=2), (6, 8), 2, stride=2),
    ],
)
def test_padding_modes_and_unfold_run_torchs_kernels(f) -> None:  # type: ignore[no-untyped-def]
    # decomposed they gather with index tensors: 20-30x (padding), 3-4x (unfold) slower
    r = compiled(f, torch.randn(2, 3, 6, 8))
    assert not any("index" in g.kernel for g in r.groups)
    assert r.kernels_after == r.kernels_before
    whole = [g for g in r.groups if g.pattern == "fallback"]
    assert whole and all("torch's" in g.reason and "slower" in g.reason for g in whole)


def test_user_attention_runs_torchs_flash_kernel() -> None:
    # decomposed it ran 0.73-0.91x eager (sequences 32-512)
    q, k, v = (torch.randn(2, 4, 40, 16) for _ in range(3))
    r = compiled(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v)
    assert r.kernels_after == 1
    assert "flash" in r.groups[0].kernel
    assert "flash attention kernel" in r.groups[0].reason


@pytest.mark.parametrize(
    ("shape", "pad"),
    [((2, 3, 9), (2, 3)), ((2, 3, 6, 8), (1, 2, 3, 0)), ((1, 2, 4, 5, 6), (1, 1, 2, 2, 1, 1))],
)
def test_circular_padding_is_concatenations_of_wrapped_slices(
    shape: tuple[int, ...], pad: tuple[int, ...]
) -> None:
    # torch's composite writes slices into an empty tensor: functionalized, a slice_scatter
    # per side, each copying the whole output (9 kernels where eager ran 2, 0.08x eager)
    r = compiled(lambda x: F.pad(x, pad, mode="circular").relu(), torch.randn(*shape))
    assert not any("scatter" in op for g in r.groups for op in g.ops)
    assert r.kernels_after <= len(pad) // 2 + 1


def test_an_output_keeps_the_strides_eager_returns() -> None:
    # The circular pad's concatenations keep a channels-last input's layout where torch's
    # pad returns contiguous: the convolution after it (opfuse's Winograd kernel, over
    # channels-last rows) then returned channels-last where eager returns contiguous.
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(16, 16, 3, padding=1, padding_mode="circular"), torch.nn.ReLU()
    ).eval()
    x = torch.randn(2, 16, 8, 8).to(memory_format=torch.channels_last)
    with torch.no_grad():
        ref = model(x)
        compiled_model = opfuse.compile(model, (x,))
        out = compiled_model(x)
    assert out.stride() == ref.stride() == (1024, 64, 8, 1)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    # the copy to eager's layout is the store of the kernel that computes the output
    groups = compiled_model.report.groups
    assert not any(g.pattern == "fallback" and "clone" in " ".join(g.ops) for g in groups)


def test_circular_padding_of_a_convolution_trains() -> None:
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3, padding=1, padding_mode="circular")
    x = torch.randn(2, 3, 7, 5, requires_grad=True)
    ref = F.silu(conv(x)).sum()
    ref.backward()
    gw, gx = conv.weight.grad.clone(), x.grad.clone()
    conv.weight.grad = None
    x.grad = None
    out = torch.compile(lambda x: F.silu(conv(x)).sum(), backend="opfuse")(x)
    out.backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(conv.weight.grad, gw)
    torch.testing.assert_close(x.grad, gx)


def test_nested_gathers_count_every_load() -> None:
    # a cat of cats reads every leaf at every position: 3 x 3 loads is over the limit of 8,
    # so torch copies the outer cat (and the inner one it reads whole)
    def f(x):  # type: ignore[no-untyped-def]
        y = torch.cat([x[:, :1], x, x[:, -1:]], 1)
        return torch.cat([y[:1], y, y[-1:]], 0).relu()

    r = compiled(f, torch.randn(5, 4, 6))
    copies = [g for g in r.groups if "copied with torch" in g.reason]
    assert [g.ops for g in copies] == [["aten.cat.default"]] * 2
    assert r.kernels_after == 3
    r = compiled(lambda x: torch.cat([x[:1], x, x[-1:]], 0).relu(), torch.randn(5, 4, 6))
    assert r.kernels_after == 1


def test_flattened_view_of_a_permuted_tensor_loops_over_its_dimensions() -> None:
    # The qkv projection's gradient in training: three [batch, heads, tokens, head_dim]
    # gradients stacked, permuted to [batch, tokens, 3, heads, head_dim] and flattened to
    # [tokens, 3 * heads * head_dim] for the weight GEMM and the bias gradient's column
    # sum. On the flattened column every index took x // 16, x % 16, (x // 16) % 4 and
    # x // 64 and each load gathered; split into (3, 4, 16) loops they are all affine.
    def qkv_grad(q, k, v):  # type: ignore[no-untyped-def]
        g = torch.stack((q, k.transpose(-1, -2), v)).permute(1, 3, 0, 2, 4).reshape(2 * 6, 192)
        return g, g.sum(0)

    q, v = torch.randn(2, 4, 6, 16), torch.randn(2, 4, 6, 16)
    k = torch.randn(2, 4, 16, 6)
    m = Fn(qkv_grad).eval()
    fast = opfuse.compile(m, (q, k, v))
    assert_matches_eager(m, fast(q, k, v), (q, k, v))
    assert fast.report.kernels_after == 1
    src = fast._first.compiled.source
    assert not re.search(r"\bx\d\) [/%]", src), src


def test_a_short_split_of_the_vector_loop_is_left_gathering() -> None:
    # pixel shuffle by 2: the output's w takes the input apart as (w // 2, w % 2); split
    # there, the vector loop would be 2 long
    x = torch.randn(1, 8, 5, 6)
    m = Fn(lambda x: F.pixel_shuffle(x, 2).relu()).eval()
    fast = opfuse.compile(m, (x,))
    assert_matches_eager(m, fast(x), (x,))
    assert re.search(r"x\d\) % 2", fast._first.compiled.source)


@pytest.mark.parametrize("perm", [(0, 2, 1), (2, 1, 0), (1, 0, 2), (2, 0, 1)])
def test_large_transposing_copies_walk_tiles(perm: tuple[int, int, int]) -> None:
    # read a row apart at every step of the vector loop, an input larger than L2 is walked
    # in 16 x 16 tiles (4096x1024 transposed: 16.7 -> 4.1 ms); one keeping the contiguous
    # dimension innermost (1, 0, 2) has nothing to tile
    x = torch.randn(48, 64, 96)
    m = Fn(lambda x: x.permute(perm).contiguous() * 2 + 1).eval()
    fast = opfuse.compile(m, (x,))
    assert_matches_eager(m, fast(x), (x,))
    assert fast.report.kernels_after == 1
    tiled = "u < 16; " in fast._first.compiled.source
    assert tiled == (perm[-1] != 2)


@pytest.mark.parametrize(
    ("shape", "cases"),
    [
        ((2, 197, 2304), 2),  # ViT's K^T: [197, 768] of a [197, 2304] row -> [768, 197]
        ((4, 300, 250), 3),  # neither extent a multiple of 16: the squares, then two strips
        ((2, 256, 1000), 2),
        ((4, 64, 1024), 0),  # whole squares only: one kernel, no cases
    ],
)
def test_transposing_copies_tile_whole_squares_and_walk_the_rest(
    shape: tuple[int, int, int], cases: int
) -> None:
    # extents that are no multiple of 16 were left untiled: ViT-B/16's K^T copy at batch 8
    # 0.53 ms, tiled with its 5 leftover columns walked as before 0.12 ms
    x = torch.randn(shape)
    c = shape[2] // 3 if shape[2] == 2304 else 0
    m = Fn(lambda x: x[..., c:].transpose(1, 2).contiguous() * 2 + 1).eval()
    fast = opfuse.compile(m, (x,))
    assert_matches_eager(m, fast(x), (x,))
    src = fast._first.compiled.source
    assert "u < 16; " in src
    assert (f"as {cases} cases of" in src) == bool(cases), src[:400]


def test_writes_to_slices_inside_forward_are_read_through() -> None:
    # functionalised, `y[:, :4] = y[:, :4] * 2` and `z[..., 1::2] += 1` are slice_scatters:
    # the kernels compute them where they read them instead of torch copying twice each
    lin = torch.nn.Linear(16, 16)

    def f(x):  # type: ignore[no-untyped-def]
        y = lin(x)
        y[:, :4] = y[:, :4] * 2
        z = y.clone()
        z[..., 1::2] += 1.0
        return torch.relu(z)

    r = compiled(f, torch.randn(4, 16))
    assert r.kernels_before == 7
    assert r.kernels_after == 2  # the linear, then one kernel
    assert all(g.pattern != "fallback" for g in r.groups)


@settings(max_examples=30, deadline=None)
@given(
    dim=st.integers(0, 1),
    start=st.integers(-9, 9) | st.none(),
    end=st.integers(-9, 9) | st.none(),
    step=st.integers(1, 3),
)
def test_slice_scatter_matches_eager(dim: int, start, end, step: int) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(7, 9)
    idx = [slice(None)] * 2
    idx[dim] = slice(start, end, step)
    src = x[tuple(idx)]

    def f(x, src):  # type: ignore[no-untyped-def]
        return torch.slice_scatter(x.sin(), src * 3, dim, start, end, step) + 1

    compiled(f, x, src.clone())


def test_the_gradient_of_a_slice_fuses_into_the_backward_kernel() -> None:
    # slice_backward is zeros + slice_scatter: read through, no torch copy in the backward
    from opfuse.frontend.dynamo import collect_reports

    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 32)

    class M(torch.nn.Module):
        def forward(self, x):  # type: ignore[no-untyped-def]
            y = lin(x)
            return (y[:, 2:10].relu() * 3).sum() + y[:, 20:].tanh().sum()

    x = torch.randn(8, 16)
    report = collect_reports(M(), (x,), {}, backward=True)
    assert not [g for g in report.groups if g.pattern == "fallback"]
    lin.zero_grad()
    M()(x).backward()
    want = [p.grad.clone() for p in lin.parameters()]
    lin.zero_grad()
    torch._dynamo.reset()
    torch.compile(M(), backend="opfuse")(x).backward()
    for p, w in zip(lin.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad, w)


class _RelativeBias(torch.nn.Module):
    """Swin's relative position bias: a frozen table gathered by a frozen index."""

    def __init__(self, window: int = 7, heads: int = 3) -> None:
        super().__init__()
        self.w, self.heads = window, heads
        self.table = torch.nn.Parameter(torch.randn((2 * window - 1) ** 2, heads))
        g = torch.Generator().manual_seed(0)
        n = window * window
        self.register_buffer(
            "index", torch.randint(0, (2 * window - 1) ** 2, (n * n,), generator=g)
        )

    def forward(self, attn: torch.Tensor) -> torch.Tensor:
        n = self.w * self.w
        bias = self.table[self.index].view(n, n, self.heads).permute(2, 0, 1)
        return (attn + bias).softmax(-1)


GATHERS = {
    "index_select": lambda t, i: t.index_select(0, i),
    "gather": lambda t, i: t.gather(0, i[:, None].expand(-1, t.shape[1])),
    "embedding": lambda t, i: F.embedding(i, t),
    "take": lambda t, i: t.take(i)[:, None],
}


def test_a_gather_of_frozen_tensors_is_computed_at_compile_time() -> None:
    m = _RelativeBias().eval()
    x = torch.randn(2, 3, 49, 49)
    fast = opfuse.compile(m, (x,))
    assert_matches_eager(m, fast(x), (x,))
    report = fast.report
    assert [g.pattern for g in report.groups] == ["reduction"], str(report)
    assert "index" in report.constants[0]
    with torch.no_grad():
        m.table.mul_(2.0)  # a frozen value changed: the next call folds it again
    with pytest.warns(RuntimeWarning, match="table was modified in place"):
        assert_matches_eager(m, fast(x), (x,))


@pytest.mark.parametrize("name", sorted(GATHERS))
def test_gathers_fold_on_constants_and_stay_torch_calls_on_inputs(name: str) -> None:
    table, idx = torch.randn(10, 4), torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    folded = compiled(lambda x: GATHERS[name](table, idx) * x, torch.randn(8, 4))
    assert [g.pattern for g in folded.groups] == ["elementwise"], str(folded)
    runtime = compiled(lambda x, i: GATHERS[name](table, i) * x, torch.randn(8, 4), idx)
    assert "fallback" in [g.pattern for g in runtime.groups]  # the index is an input


SPLITS = {
    "split": lambda x: torch.split(x * 2, [2, 3], dim=-1),
    "split_with_sizes": lambda x: (x * 2).split_with_sizes([2, 3], dim=-1),
    "aten.split_with_sizes": lambda x: torch.ops.aten.split_with_sizes(x * 2, [2, 3], -1),
    "split_with_sizes_copy": lambda x: torch.ops.aten.split_with_sizes_copy(x * 2, [2, 3], -1),
}


@pytest.mark.parametrize("how", sorted(SPLITS))
@pytest.mark.parametrize("path", ["export", "dynamo"])
def test_split_with_sizes_pieces_are_read_through_like_split(how: str, path: str) -> None:
    from opfuse.frontend.dynamo import collect_reports

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a, b = SPLITS[how](x)
        return a.relu() + 1, b.sigmoid()

    x = torch.randn(4, 5)
    if path == "export":
        report = compiled(fn, x)
    else:
        with torch.no_grad():
            report = collect_reports(Fn(fn).eval(), (x,), {})
    assert all(g.pattern == "elementwise" for g in report.groups), str(report)
    assert len(report.groups) <= 3  # x * 2, then each piece's kernel
