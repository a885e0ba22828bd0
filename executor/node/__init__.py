"""The machine the live executor runs on: its cores and memory (`local`), its memory
limit when it runs in a cgroup (`cgroups`), its free memory observed for admission
(`memwatch`)."""
