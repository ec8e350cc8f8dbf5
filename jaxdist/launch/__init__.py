"""Starting workers: what every launcher shares (:mod:`~jaxdist.launch.process`) and the
engines that start them (:mod:`~jaxdist.launch.ray`, Ray actors).

The local launcher, :mod:`jaxdist.coordinator.spawn`, builds its worker arguments and command
line here too. Nothing here imports Ray until :mod:`jaxdist.launch.ray` starts workers.
"""
