"""Post-training from a checkpoint, in the Krea 2 order: domain SFTs and their merge, preference pairs
(on-policy and human), a Bradley-Terry reward model, Diffusion-DPO, Flow-GRPO, TDM distillation into a
few-step student, and the runner they share. Imports training.core and training.evaluation."""
