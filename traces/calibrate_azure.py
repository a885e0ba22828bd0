"""Distil the Azure LLM inference trace 2023 into the small quantile table the
generators sample from (``traces/data/azure_llm_2023.json``).

Source: Azure Public Dataset, AzureLLMInferenceDataset2023 (CC BY 4.0), first
described in Patel et al., "Splitwise", ISCA 2024. Run once; the derived table
is shipped so generation needs no network and no data download:

    python -m traces.calibrate_azure ../shared/data/azure-llm-2023
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

QUANTILES = np.linspace(0, 1, 201)


def distil(folder: Path) -> dict:
    out: dict = {
        "source": "Azure LLM inference trace 2023 (AzureLLMInferenceDataset2023), CC BY 4.0; "
                  "Patel et al., Splitwise, ISCA 2024",
        "quantiles": QUANTILES.round(4).tolist(),
    }
    for name in ("code", "conv"):
        df = pd.read_csv(folder / f"AzureLLMInferenceTrace_{name}.csv")
        ts = pd.to_datetime(df["TIMESTAMP"], format="mixed").astype("int64") / 1e9
        gaps = np.diff(np.sort(ts.to_numpy()))
        out[name] = {
            "requests": len(df),
            "duration_s": float(ts.max() - ts.min()),
            "context_tokens": np.quantile(df["ContextTokens"], QUANTILES).round(1).tolist(),
            "generated_tokens": np.quantile(df["GeneratedTokens"], QUANTILES).round(1).tolist(),
            "interarrival_s": np.quantile(gaps, QUANTILES).round(5).tolist(),
        }
    return out


if __name__ == "__main__":
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "../shared/data/azure-llm-2023")
    target = Path(__file__).parent / "data" / "azure_llm_2023.json"
    target.write_text(json.dumps(distil(folder)))
    print(f"wrote {target}")
