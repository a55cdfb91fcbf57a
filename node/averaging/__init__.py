"""Background averaging between replicas of a stage: the averaging loop, its stats, and the SparTA rules."""
