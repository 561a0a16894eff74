"""Style references: self-supervised same-style pairs on the demo grammar, training the reference pathway
(model.reference) from a checkpoint, and transfer and leakage per strength."""
