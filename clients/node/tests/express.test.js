'use strict';
// The Express middleware in its default mode: the claim commits on its own, then the handler's transaction.
require('./express-suite')({});
