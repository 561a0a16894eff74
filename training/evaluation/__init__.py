"""What a checkpoint is judged by: sample grids, held-out flow loss, prompt following (the demo's
verifiable check, rubrics by a VLM), distribution metrics (FID, CMMD, DINO-MMD) and the rewards that
post-training mixes. Imports training.core only."""
