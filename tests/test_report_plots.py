"""The pass@k plot is readable (issue 30): its title is inside the figure (it was clipped) and
its k axis ends at the largest k evaluated (it ran to 16 when k <= 8)."""
import pytest

pytest.importorskip("matplotlib")

from openrlhf_div.eval.report import passk_figure, plot_passk  # noqa: E402


def _metrics(kmax, splits=()):
    curve = {str(k): min(1.0, 0.1 * k) for k in range(1, kmax + 1)}
    M = {"pass_at_k": curve}
    if splits:
        M["splits"] = {s: {"pass_at_k": curve} for s in splits}
    return {"task": "a_task_with_a_rather_long_name_for_the_title", "base": M, "methods": {"dph_js": M, "grpo": M}}


@pytest.mark.parametrize("kmax,splits", [(8, ()), (4, ()), (6, ("demo/regular", "demo/rare")), (16, ())])
def test_passk_axis_ends_at_the_largest_k_and_title_fits(kmax, splits, tmp_path):
    import matplotlib.pyplot as plt

    fig = passk_figure(_metrics(kmax, splits))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    fig_box = fig.bbox
    title = fig._suptitle.get_window_extent(renderer)
    assert title.x0 >= fig_box.x0 - 1 and title.x1 <= fig_box.x1 + 1, (title, fig_box)
    assert title.y1 <= fig_box.y1 + 1
    for ax in fig.axes:
        lo, hi = ax.get_xlim()
        assert kmax <= hi <= kmax * 1.2, (kmax, hi)
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert max(ticks) == kmax and all(t <= kmax for t in ticks), ticks
    plt.close(fig)
    assert (tmp_path / "p.png").exists() is False
    plot_passk(_metrics(kmax, splits), str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 0
