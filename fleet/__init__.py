"""N machines of ``runners.tpu_host`` from one command: launch, status, supervise, merge, teardown
(``runners/fleet.py``), on local processes, Cloud TPU VMs or a Kubernetes Indexed Job."""
