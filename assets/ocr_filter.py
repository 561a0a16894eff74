"""The `text_filter` stage (defined in assets.ocr): one module per stage name, as kiln.stage.get_stage expects."""

from assets.ocr import TEXT_FILTER_STAGE as STAGE

__all__ = ["STAGE"]
