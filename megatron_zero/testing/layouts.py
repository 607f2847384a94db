"""Every TP x PP x DP factorisation of a world size, for the topology tests."""
import itertools

from ..distributed.topology import Layout


def factorisations(world):
    """Each Layout(tp, pp, dp) with tp * pp * dp == world."""
    for tp, pp in itertools.product(range(1, world + 1), repeat=2):
        if world % (tp * pp) == 0:
            yield Layout(tp=tp, pp=pp, dp=world // (tp * pp))
