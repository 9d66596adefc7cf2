"""Curation stages, registered by name (the names a pipeline file uses)."""

from . import cluster, dedup, embed, filters, ocr, recaption, scores  # noqa: F401  (registration)
from .base import REGISTRY, GlobalStage, MapStage, Options, Stage, register, stable_u64

__all__ = ["REGISTRY", "GlobalStage", "MapStage", "Options", "Stage", "register", "stable_u64"]
