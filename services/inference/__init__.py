"""The one inference engine that serving, training rollouts and evaluation share."""
