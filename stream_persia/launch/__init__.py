"""Starting a job: the console script, each role's entry point, and ``run``.

- :mod:`~stream_persia.launch.cli`: the ``stream-persia`` console script (its flags are
  checked by the argparse types of :mod:`~stream_persia.config.flags`).
- :mod:`~stream_persia.launch.roles`: ``launch <role>`` (server, worker, NN, API);
  :mod:`~stream_persia.launch.memory`: the process memory settings every role applies.
- :mod:`~stream_persia.launch.run`: ``run TOPOLOGY`` (every role on this machine);
  :mod:`~stream_persia.launch.run_args`: its flags and their checks;
  :mod:`~stream_persia.launch.samples_topic`: the samples topic of a Kafka run;
  :mod:`~stream_persia.launch.report`: its report and plot;
  :mod:`~stream_persia.launch.topology`: ``topology.yml``.
- :mod:`~stream_persia.launch.stop_signals`: how ``run`` and each role stop on a signal.
- :mod:`~stream_persia.launch.processes`: role child processes;
  :mod:`~stream_persia.launch.rank`: one NN rank under torchrun;
  :mod:`~stream_persia.launch.torchrun`: torchrun, its store on loopback on one host.
"""
