"""Starting a job: the console script, each role's entry point, and ``run``.

- :mod:`~stream_persia.launch.cli`: the ``stream-persia`` console script (its flags are
  checked by the argparse types of :mod:`~stream_persia.config.flags`).
- :mod:`~stream_persia.launch.roles`: ``launch <role>`` (server, worker, NN, API).
- :mod:`~stream_persia.launch.run`: ``run TOPOLOGY`` (every role on this machine);
  :mod:`~stream_persia.launch.report`: its report and plot;
  :mod:`~stream_persia.launch.topology`: ``topology.yml``.
- :mod:`~stream_persia.launch.processes`: role child processes;
  :mod:`~stream_persia.launch.rank`: one NN rank under torchrun.
"""
