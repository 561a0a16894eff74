"""Shared parts that curation (assets/) and training (training/) both use, below them and above model/:
the demo grammar (the stand-in world with known captions), VLM and LLM loading, OCR engines, yes/no
scoring and the rule-based text tools the demo's stand-ins write with. Imports model/ and kiln's base only."""
