"""Model roles as workers: the policy (actor, rollout, reference), the critic and score models (rule rewards are
`hfjax.rewards`')."""
