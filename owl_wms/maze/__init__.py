"""The maze world this project trains: the simulator, its exploring policies and levels, the
evaluation against the simulator, and the training chain. It uses the library (owl_wms);
the library never imports it."""
