"""`pdserve bench serve`: an open-loop load generator for a running cluster and its SLO report.

Arrival schedules (`arrivals`) and request workloads (`workloads`) are pure and seeded;
`client` sends them through the public `Generation` API and records when each token
arrived; `metrics` turns those traces into TTFT, TPOT, inter-token gaps, SLO attainment
and goodput; `sweep` bisects for the highest rate that still meets the SLOs; `report`
writes the JSON and the plots; `cli` is the command line.
"""
