"""mindvl.curate: data curation the MindVL way (paper section 4 and appendix B).

    PipelineConfig.load("pipeline.yaml")   validated pipeline (inputs, output, engine, ordered stages)
    run_pipeline(cfg)                      run or resume it; output shards are trainable by `mindvl train`
    iter_output(out)                       the curated records

Stages (mindvl.curate.stages): image_filter, text_filter, phash_dedup, embed, clip_score, cluster (k-means +
re-clustering + variance-proportional sampling + SemDeDup), ocr (two engines intersected), recaption.
Engines (mindvl.curate.executors): inprocess, local worker processes, Ray Data.
"""

from .io import iter_output
from .pipeline import EngineConfig, PipelineConfig
from .runner import RunResult, run_pipeline

__all__ = ["EngineConfig", "PipelineConfig", "RunResult", "iter_output", "run_pipeline"]
