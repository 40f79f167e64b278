"""`ppserve plan`: which deployment serves a model best on a cluster under an SLO, found on the simulator.

space.py enumerates the deployments that fit (and why the others do not), search.py finds each one's
capacity under the SLO on the simulator, report.py writes the ranked table, the Pareto front and the
winner's engine config, inputs.py reads the command line's model, cluster and workload, cli.py is the
command. It reads the simulator, the scheduler and the configs only: never the workers, Ray or torch.
"""
