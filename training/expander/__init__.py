"""The prompt expander beside the generator: a causal LM by path (or the demo's tiny one), its SFT on
(user prompt -> long caption), GDPO RL on faithfulness, image and diversity rewards, and its evaluation."""
