"""Draw the training loss of one or more runs from their TensorBoard directories into a PNG.

    python tools/plot_loss.py RUN_DIR [RUN_DIR ...] [--labels A B ...] [--output loss.png]

Each RUN_DIR is a --tensorboard-dir: its `lm loss` scalars (one per iteration) are a line, its
`lm loss validation` scalars (with --eval-iters) points of the same colour. A run that starts after
iteration 1 resumed from a checkpoint: a dotted vertical line marks the iteration it resumed from, named
after it. scripts/demo.sh draws its TP2 x PP2 run and the TP1 x DP4 run resumed from its universal
checkpoint this way. Needs matplotlib (pip install 'megatron_zero[plot]'); TensorBoard's event reader
comes with the package's requirements.
"""
import argparse
import os
import sys

TRAIN, VALIDATION = "lm loss", "lm loss validation"


def read_run(directory: str):
    """({iteration: loss}, {iteration: validation loss}) from a TensorBoard directory."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(directory, size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags().get("scalars", []))
    series = [{e.step: e.value for e in events.Scalars(tag)} if tag in tags else {} for tag in (TRAIN, VALIDATION)]
    return series[0], series[1]


def plot(runs, labels, output: str) -> None:
    """`runs`: [(train {it: loss}, validation {it: loss})], drawn into `output` (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for k, ((train, valid), label) in enumerate(zip(runs, labels)):
        color = f"C{k}"
        steps = sorted(train)
        ax.plot(steps, [train[s] for s in steps], color=color, linewidth=1.4, label=label)
        if valid:
            points = sorted(valid)
            ax.plot(points, [valid[s] for s in points], "o", color=color, markersize=4,
                    label=f"{label}: validation")
        if steps and steps[0] > 1:
            ax.axvline(steps[0] - 1, color=color, linestyle=":", linewidth=1.2)
            ax.annotate(f"resumed at iteration {steps[0] - 1}", xy=(steps[0] - 1, 1.0), xycoords=("data", "axes fraction"),
                        xytext=(4, -14), textcoords="offset points", color=color, fontsize=9)
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, frameon=False)  # below: the
    fig.savefig(output, format="png", bbox_inches="tight")  # curves and the resume's note keep the plot
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="--tensorboard-dir of a run")
    parser.add_argument("--labels", nargs="+", help="one name per RUN_DIR (default: the directory names)")
    parser.add_argument("--output", default="loss.png", help="the PNG to write (default: loss.png)")
    a = parser.parse_args(argv)

    def fail(sentence):
        print(f"plot_loss.py: error: {sentence}", file=sys.stderr)
        return 2

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return fail("drawing needs matplotlib, which is not installed (pip install matplotlib, or "
                    "pip install 'megatron_zero[plot]')")
    if a.labels is not None and len(a.labels) != len(a.runs):
        return fail(f"--labels gives {len(a.labels)} names for {len(a.runs)} run directories; give one per directory")
    labels = a.labels or [os.path.basename(os.path.normpath(r)) for r in a.runs]
    runs = []
    for directory in a.runs:
        if not os.path.isdir(directory):
            return fail(f"{directory} is not a directory (give the --tensorboard-dir of a run)")
        train, valid = read_run(directory)
        if not train:
            return fail(f"{directory} holds no '{TRAIN}' scalars: is it a run's --tensorboard-dir?")
        runs.append((train, valid))
    plot(runs, labels, a.output)
    print(f"wrote {a.output}: the lm loss of {'; '.join(labels)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
