"""The paper's numbers, in one table, apart from the computation that sets ours beside them.

Each constant names where in ARL-Tangram (Xiao et al., 2026; /work/shared/paper) it is
stated, and what the paper says of its setup. The report reads values from here only;
nothing in this module is an input to a simulation.
"""

from __future__ import annotations

from dataclasses import dataclass

CITATION = "ARL-Tangram (Xiao et al., 2026), section 6"


@dataclass(frozen=True)
class PaperValue:
    value: float | str
    unit: str
    where: str
    #: what the paper states of the setup behind the number (or that it does not)
    setup: str = ""

    @property
    def number(self) -> float | None:
        return self.value if isinstance(self.value, float | int) else None


PAPER: dict[str, PaperValue] = {
    "coding_act": PaperValue(4.3, "x", "sec. 6, Fig. 7 text: total ACT 4.3x lower",
                             "k8s, one pod per trajectory; pod size not stated"),
    "coding_env": PaperValue(9.0, "x", "sec. 6, Fig. 7 text: environment interaction 9.0x",
                             "credited to removing intra-trajectory over-provisioning"),
    "coding_reward": PaperValue(2.8, "x", "sec. 6, Fig. 7 text: reward computation 2.8x",
                                "credited to elastic DoP for scalable actions"),
    "coding_step": PaperValue(1.4, "x", "sec. 6, training speed: AI Coding step 1.4x faster"),
    "deepsearch_step": PaperValue(1.5, "x", "sec. 6, training speed: DeepSearch step 1.5x",
                                  "baseline: per-trajectory API calls with retries, 5 judge "
                                  "replicas; search quota not stated"),
    "cpu_scal_small": PaperValue(3.1, "x", "sec. 6, Fig. 8: CPU, 3.1x at the smallest batch"),
    "cpu_scal_large": PaperValue(27.7, "x", "sec. 6, Fig. 8: CPU, 27.7x at the largest batch"),
    "gpu_static": PaperValue(18.1, "x", "sec. 6, Fig. 8: 18.1x faster than SGLang at batch 2048",
                             "9 teachers deployed with SGLang; demand per teacher not stated"),
    "gpu_saved": PaperValue(71.2, "%", "sec. 6, Fig. 8: same ACT with 29% of the GPUs "
                                       "(71.2% saved)"),
    "ablation_dop16": PaperValue(3.0, "x", "sec. 6, Fig. 9: 3.0x vs DoP=16 at batch 1280"),
    "table1_cpu": PaperValue("< 3", "%", "sec. 6, Table 1: CPU overhead under 3% of execution"),
    "table1_gpu": PaperValue("~25", "%", "sec. 6, Table 1: GPU restore overhead ~25%"),
}

#: what the paper says (and does not say) about the demand across MOPD teachers: Fig. 3(d)
#: plots *call counts over the training run* of two tasks (DeepSearch, MOPD), varying by
#: up to three orders of magnitude in time (no calls at all while training); it is not a
#: split across teachers. Fig. 3(b): SM activity of 12 teacher GPUs fluctuates "in time and
#: across models", mean < 3%: models differ in load, by how much is not given.
TEACHER_DEMAND_NOTE = ("the paper gives no split of calls across teachers (Fig. 3(d) is "
                       "call counts over the training run; Fig. 3(b): load differs across "
                       "models, amount not given)")


def value(key: str) -> float | str:
    return PAPER[key].value
