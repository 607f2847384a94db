"""Rank <-> (pp, dp, tp) coordinates and every process group.

The layout is Megatron's and DeepSpeed's: TP ranks are adjacent (fastest axis),
then DP, then PP:  rank = pp * (DP * TP) + dp * TP + tp.

Context parallelism (CP) sits between TP and DP, in Megatron-Core's order tp-cp-dp-pp:
rank = pp * (DP * CP * TP) + (dp * CP + cp) * TP + tp. CP ranks hold the same parameters and
take part in the gradient reduction, so the middle coordinate of `coords` and the `dp` group
span DP x CP (Megatron-Core's data-parallel group "with CP": ZeRO partitions over it, and a
checkpoint has DP x CP optimizer files); the data loader's replicas are the DP ranks alone
(`data_parallel_rank`), and the `cp` group holds the ranks that split one sequence.

`Layout` answers every question about the layout as pure functions (no process
groups), so offline tools reading checkpoints can use it. `ParallelState` holds
the torch.distributed groups for one rank; `build_parallel_state` is the only
place in the project that creates groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple


class TopologyError(ValueError):
    """A layout that cannot be built; the message is one sentence naming the numbers."""


@dataclass(frozen=True)
class Layout:
    """A factorisation world = tp * pp * dp * cp."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1

    def __post_init__(self):
        for name in ("tp", "pp", "dp", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise TopologyError(f"the {name} size must be a positive integer, got {value!r}")

    @classmethod
    def from_world(cls, world_size: int, tp: int = 1, pp: int = 1, cp: int = 1) -> "Layout":
        if world_size % (tp * pp * cp) != 0:
            with_cp = f" x --context-parallel-size {cp}" if cp > 1 else ""
            raise TopologyError(
                f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
                f"--pipeline-model-parallel-size {pp}{with_cp} (= {tp * pp * cp}); choose sizes whose product divides it")
        return cls(tp=tp, pp=pp, dp=world_size // (tp * pp * cp), cp=cp)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def dp_cp(self) -> int:
        """The gradient-reduction domain: DP x CP ranks (DP when CP = 1)."""
        return self.dp * self.cp

    @property
    def mp_size(self) -> int:
        """Model-parallel size (TP x PP)."""
        return self.tp * self.pp

    # ---- coordinates -------------------------------------------------------
    def coords(self, rank: int) -> Tuple[int, int, int]:
        """(pp, dp, tp) coordinates of a global rank; dp indexes the DP x CP domain (dp * CP + cp)."""
        self._check_rank(rank)
        return rank // (self.dp_cp * self.tp), (rank // self.tp) % self.dp_cp, rank % self.tp

    def rank(self, pp: int, dp: int, tp: int) -> int:
        if not (0 <= pp < self.pp and 0 <= dp < self.dp_cp and 0 <= tp < self.tp):
            raise TopologyError(f"coordinates (pp={pp}, dp={dp}, tp={tp}) lie outside {self}")
        return pp * self.dp_cp * self.tp + dp * self.tp + tp

    def cp_rank(self, rank: int) -> int:
        """Which part of the sequence a rank holds (0..CP-1)."""
        return self.coords(rank)[1] % self.cp

    def data_parallel_rank(self, rank: int) -> int:
        """Which data replica a rank belongs to (0..DP-1): the CP ranks of one replica read the same samples."""
        return self.coords(rank)[1] // self.cp

    def mp_rank(self, rank: int) -> int:
        """Rank within the model-parallel group: pp * TP + tp (DeepSpeed's mp_rank)."""
        pp, _, tp = self.coords(rank)
        return pp * self.tp + tp

    def mp_coords(self, mp_rank: int) -> Tuple[int, int]:
        """(pp, tp) of a model-parallel rank."""
        if not 0 <= mp_rank < self.mp_size:
            raise TopologyError(f"model-parallel rank {mp_rank} lies outside 0..{self.mp_size - 1}")
        return mp_rank // self.tp, mp_rank % self.tp

    # ---- groups as rank lists ---------------------------------------------
    def tp_group(self, rank: int) -> List[int]:
        pp, dp, _ = self.coords(rank)
        return [self.rank(pp, dp, t) for t in range(self.tp)]

    def dp_group(self, rank: int) -> List[int]:
        """The gradient-reduction group: DP x CP ranks."""
        pp, _, tp = self.coords(rank)
        return [self.rank(pp, d, tp) for d in range(self.dp_cp)]

    def cp_group(self, rank: int) -> List[int]:
        """The ranks that split one sequence, in CP-rank order."""
        pp, d, tp = self.coords(rank)
        first = d - d % self.cp
        return [self.rank(pp, first + c, tp) for c in range(self.cp)]

    def pp_group(self, rank: int) -> List[int]:
        _, dp, tp = self.coords(rank)
        return [self.rank(p, dp, tp) for p in range(self.pp)]

    def mp_group(self, rank: int) -> List[int]:
        _, dp, _ = self.coords(rank)
        return [self.rank(p, dp, t) for p in range(self.pp) for t in range(self.tp)]

    def embedding_group(self, rank: int) -> List[int]:
        """First and last pipeline stage of this rank's pipeline (one rank when PP=1)."""
        group = self.pp_group(rank)
        return sorted({group[0], group[-1]})

    def all_groups(self, kind: str, *args) -> List[List[int]]:
        """Every group of one kind, in a fixed order (the order groups are created in)."""
        getter = getattr(self, f"{kind}_group")
        seen, groups = set(), []
        for r in range(self.world_size):
            g = tuple(getter(r, *args))
            if g not in seen:
                seen.add(g)
                groups.append(list(g))
        return groups

    # ---- expert parallelism (carved out of TP x CP x DP, as Megatron-Core does) ----
    # Megatron-Core's expert RankGenerator (order tp-ep-dp-pp, no CP dimension: its data-parallel size is
    # world / (ETP x EP x PP)): within a pipeline stage, stage rank i = d * TP + tp (d = dp * CP + cp, the
    # DP x CP index of `coords`) has expert coordinates etp = i % ETP, ep = (i // ETP) % EP,
    # edp = i // (ETP x EP) (ETP x EP x EDP = TP x CP x DP). At ETP = TP that is ep = d % EP, edp = d // EP:
    # EP consecutive ranks of the DP x CP domain (with CP, EP spans the CP ranks first).
    def check_expert_parallel(self, ep: int, etp: Optional[int] = None) -> None:
        """Refuse, in one sentence, an expert-parallel (and expert-tensor-parallel) size this layout cannot hold."""
        etp = self.tp if etp is None else etp
        domain = "DP x CP" if self.cp > 1 else "DP"
        if etp == self.tp and (not isinstance(ep, int) or ep < 1 or self.dp_cp % ep):
            if self.cp == 1:
                raise TopologyError(f"--expert-model-parallel-size {ep} must divide the data-parallel size {self.dp} "
                                    f"({self}): expert parallelism is carved out of the DP ranks")
            raise TopologyError(f"--expert-model-parallel-size {ep} must divide the data-parallel size {self.dp} x "
                                f"--context-parallel-size {self.cp} (= {self.dp_cp}): expert parallelism is carved out "
                                "of the DP x CP ranks, so it must divide the data-parallel x context-parallel size "
                                f"{self.dp_cp} of {self}")
        if etp != self.tp and self.cp > 1:
            raise TopologyError(f"--expert-tensor-parallel-size {etp} other than TP with --context-parallel-size "
                                f"{self.cp} is not available: give --expert-tensor-parallel-size equal to "
                                f"--tensor-model-parallel-size {self.tp} with context parallelism")
        if not isinstance(etp, int) or etp < 1 or not isinstance(ep, int) or ep < 1 \
                or (self.tp * self.dp_cp) % (etp * ep):
            raise TopologyError(f"--expert-tensor-parallel-size {etp} x --expert-model-parallel-size {ep} must divide "
                                f"TP x {domain} = {self.tp * self.dp_cp} of each pipeline stage ({self}): the "
                                "experts' tensor-, expert- and expert-data-parallel groups are carved out of those ranks")

    def expert_coords(self, rank: int, ep: int, etp: Optional[int] = None) -> Tuple[int, int, int]:
        """(etp, ep, edp) coordinates of a rank within its pipeline stage."""
        etp = self.tp if etp is None else etp
        pp, dp, tp = self.coords(rank)
        i = dp * self.tp + tp
        return i % etp, (i // etp) % ep, i // (etp * ep)

    def expert_rank(self, pp: int, etp_rank: int, ep_rank: int, edp_rank: int, ep: int, etp: int) -> int:
        """The global rank of expert coordinates (etp, ep, edp) in stage pp (the inverse of expert_coords)."""
        i = (edp_rank * ep + ep_rank) * etp + etp_rank
        return self.rank(pp, i // self.tp, i % self.tp)

    def _expert_group(self, rank: int, ep: int, etp: Optional[int], axis: int) -> List[int]:
        etp = self.tp if etp is None else etp
        pp = self.coords(rank)[0]
        coords = list(self.expert_coords(rank, ep, etp))
        size = (etp, ep, self.tp * self.dp_cp // (etp * ep))[axis]
        members = []
        for c in range(size):
            coords[axis] = c
            members.append(self.expert_rank(pp, *coords, ep, etp))
        return members

    def expert_tp_group(self, rank: int, ep: int, etp: Optional[int] = None) -> List[int]:
        """The experts' tensor-parallel group: ETP consecutive ranks of a stage, holding slices of the same
        experts (the TP group itself at ETP = TP)."""
        return self._expert_group(rank, ep, etp, 0)

    def ep_group(self, rank: int, ep: int, etp: Optional[int] = None) -> List[int]:
        """The expert-parallel group: `ep` ranks ETP apart (at ETP = TP: consecutive DP x CP ranks, d // ep alike),
        each holding E / ep experts."""
        return self._expert_group(rank, ep, etp, 1)

    def expert_dp_group(self, rank: int, ep: int, etp: Optional[int] = None) -> List[int]:
        """The expert-data-parallel group: the ranks holding the same expert slices (at ETP = TP: the DP ranks
        x CP ranks with d % ep alike), over which expert gradients are reduced and expert optimizer state is partitioned."""
        return self._expert_group(rank, ep, etp, 2)

    # ---- pipeline neighbours ----------------------------------------------
    def prev_stage_rank(self, rank: int) -> Optional[int]:
        pp, dp, tp = self.coords(rank)
        return None if pp == 0 else self.rank(pp - 1, dp, tp)

    def next_stage_rank(self, rank: int) -> Optional[int]:
        pp, dp, tp = self.coords(rank)
        return None if pp == self.pp - 1 else self.rank(pp + 1, dp, tp)

    def _check_rank(self, rank: int):
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} lies outside a world of {self.world_size} ({self})")

    def __str__(self):
        return f"TP={self.tp} x PP={self.pp} x DP={self.dp}" + (f" x CP={self.cp}" if self.cp > 1 else "")


GROUP_KINDS = ("tp", "dp", "pp", "mp", "embedding")


def hierarchical_cp_ranks(cp_ranks: List[int], a2a: int) -> Tuple[List[List[int]], List[List[int]]]:
    """--cp-comm-type a2a+p2p's groups within one CP group (Megatron-Core's create_hierarchical_groups with
    sizes [a2a, cp / a2a]): the all-to-all groups of `a2a` consecutive CP ranks, and the ring groups of the
    ranks holding the same place in them."""
    cp = len(cp_ranks)
    if a2a < 1 or cp % a2a:
        raise TopologyError(f"--hierarchical-context-parallel-sizes: the all-to-all size {a2a} must divide "
                            f"--context-parallel-size {cp}")
    a2a_groups = [cp_ranks[j:j + a2a] for j in range(0, cp, a2a)]
    p2p_groups = [cp_ranks[i::a2a] for i in range(a2a)]
    return a2a_groups, p2p_groups


@dataclass
class ParallelState:
    """One rank's view of the layout: its coordinates and its process groups."""

    layout: Layout
    rank: int
    groups: dict  # kind -> torch.distributed ProcessGroup
    ep_size: int = 1  # expert-parallel size; > 1 (or etp_size != TP): groups has "ep", "expert_dp", "expert_tp"
    etp_size: Optional[int] = None  # expert-tensor-parallel size (None: TP)

    @property
    def ep_group(self):
        """The expert-parallel group (None without expert parallelism)."""
        return self.groups.get("ep")

    @property
    def expert_dp_group(self):
        """The expert-data-parallel group (None without expert parallelism: experts reduce over DP)."""
        return self.groups.get("expert_dp")

    @property
    def expert_tp_group(self):
        """The experts' tensor-parallel group where it differs from the TP group (None at ETP = TP)."""
        return self.groups.get("expert_tp") if self.etp_size not in (None, self.layout.tp) else None

    @property
    def expert_dp_rank(self) -> int:
        """This rank's place in its expert-data-parallel group (d // EP at ETP = TP, d the DP x CP index)."""
        return self.layout.expert_coords(self.rank, self.ep_size, self.etp_size)[2]

    @property
    def expert_mp_rank(self) -> int:
        """The model-parallel index of this rank's expert slices: pp * ETP + expert-TP rank (mp_rank at ETP = TP)."""
        etp = self.etp_size or self.layout.tp
        return self.pp_rank * etp + self.layout.expert_coords(self.rank, self.ep_size, etp)[0]

    @property
    def tp_rank(self) -> int:
        return self.layout.coords(self.rank)[2]

    @property
    def dp_rank(self) -> int:
        """This rank's index in the gradient-reduction domain (DP x CP)."""
        return self.layout.coords(self.rank)[1]

    @property
    def pp_rank(self) -> int:
        return self.layout.coords(self.rank)[0]

    @property
    def mp_rank(self) -> int:
        return self.layout.mp_rank(self.rank)

    @property
    def cp_rank(self) -> int:
        return self.layout.cp_rank(self.rank)

    @property
    def cp_size(self) -> int:
        return self.layout.cp

    @property
    def cp_group(self):
        """The context-parallel group; None when CP = 1."""
        return self.groups.get("cp")

    @property
    def cp_hierarchy(self):
        """--cp-comm-type a2a+p2p: (this rank's all-to-all group, its ring group); None otherwise."""
        return (self.groups["cp_a2a"], self.groups["cp_p2p"]) if "cp_a2a" in self.groups else None

    @property
    def data_parallel_rank(self) -> int:
        """The data replica (the sampler's rank): dp_rank without the CP part."""
        return self.layout.data_parallel_rank(self.rank)

    @property
    def data_parallel_size(self) -> int:
        return self.layout.dp

    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def dp_size(self) -> int:
        """The gradient-reduction domain's size, DP x CP (ZeRO's partition count)."""
        return self.layout.dp_cp

    @property
    def pp_size(self) -> int:
        return self.layout.pp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    @property
    def tp_group(self):
        return self.groups["tp"]

    @property
    def dp_group(self):
        return self.groups["dp"]

    @property
    def pp_group(self):
        return self.groups["pp"]

    @property
    def mp_group(self):
        return self.groups["mp"]

    @property
    def embedding_group(self):
        return self.groups["embedding"]

    @property
    def prev_rank(self) -> Optional[int]:
        return self.layout.prev_stage_rank(self.rank)

    @property
    def next_rank(self) -> Optional[int]:
        return self.layout.next_stage_rank(self.rank)


def build_parallel_state(tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, etp: Optional[int] = None,
                         cp_a2a: int = 0) -> ParallelState:
    """Create every group on an initialised torch.distributed world (with ep > 1, or an expert-tensor-parallel
    size `etp` other than tp, also the expert-parallel, expert-data-parallel and expert-tensor-parallel groups,
    after the others; with cp_a2a, --cp-comm-type a2a+p2p's all-to-all groups of `cp_a2a` consecutive CP
    ranks and ring groups within each CP group, last).

    Every rank must call this with the same sizes: each group is created by all
    ranks in the same order, as torch.distributed requires.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("build_parallel_state needs torch.distributed initialised first "
                           "(megatron_zero.distributed.initialize.init_distributed)")
    layout = Layout.from_world(dist.get_world_size(), tp=tp, pp=pp, cp=cp)
    etp = tp if etp is None else etp
    layout.check_expert_parallel(ep, etp)
    rank = dist.get_rank()
    groups = {}
    for kind in GROUP_KINDS + (("cp",) if cp > 1 else ()):
        mine = getattr(layout, f"{kind}_group")(rank)
        for ranks in layout.all_groups(kind):
            group = dist.new_group(ranks)
            if ranks == mine:
                groups[kind] = group
    if ep > 1 or etp != tp:
        for kind in ("ep", "expert_dp") + (("expert_tp",) if etp != tp else ()):
            mine = getattr(layout, f"{kind}_group")(rank, ep, etp)
            for ranks in layout.all_groups(kind, ep, etp):
                group = dist.new_group(ranks)
                if ranks == mine:
                    groups[kind] = group
    if cp_a2a:
        levels = [hierarchical_cp_ranks(cp_ranks, cp_a2a) for cp_ranks in layout.all_groups("cp")]
        for kind, level in (("cp_a2a", 0), ("cp_p2p", 1)):
            for ranks in (g for per_cp_group in levels for g in per_cp_group[level]):
                group = dist.new_group(ranks)
                if rank in ranks:
                    groups[kind] = group
    return ParallelState(layout=layout, rank=rank, groups=groups, ep_size=ep, etp_size=etp)


def build_hpz_group(layout: Layout, rank: int, size: int):
    """ZeRO++ hpZ's secondary group for ``rank``: its DP group cut into consecutive blocks of ``size``
    ranks (DeepSpeed's zero_hpz_partition_size; the GPUs of one node when it is their count).
    Collective: every rank creates every block, in the same order."""
    import torch.distributed as dist

    mine = None
    for dp_ranks in layout.all_groups("dp"):
        if len(dp_ranks) % size:
            raise ValueError(f"zero_hpz_partition_size {size} does not divide the data-parallel size "
                             f"{len(dp_ranks)}")
        for i in range(0, len(dp_ranks), size):
            block = dp_ranks[i:i + size]
            group = dist.new_group(block)
            if rank in block:
                mine = group
    return mine
