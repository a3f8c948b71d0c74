"""What a model serves next and the evidence that changes it: the version policy, the rollout plan (pure steps from
the repository and the model's entry now to its next entry), the rules judged on the evidence, the evidence itself
(shadow comparisons, traffic) and the shadow job that gathers it. Imports the loaded, batching and decoding wings
only."""
