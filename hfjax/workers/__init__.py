"""Model roles as workers: the policy (actor, rollout, reference), the critic, score models, rule rewards."""
